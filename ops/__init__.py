"""Tools around the request path: doctor and its probes, model shapes, the default model's assets, progress, JSONL."""
