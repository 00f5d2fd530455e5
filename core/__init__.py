"""The engine core: config, requests, KV cache, scheduler, model runner, sampler, engine."""
