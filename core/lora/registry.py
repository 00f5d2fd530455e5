"""The front end's adapters: names added with `add_lora_adapter` (or `--lora-modules`) and the LoRARequests seen,
each folder checked once here (config, targets, rank, shapes) so a bad adapter is a ValueError before anything is
queued; the engine process loads the weights when a request first needs them."""

from __future__ import annotations

from dataclasses import replace

from vserve.core.lora.adapter import LoRARequest, inspect_adapter, resolve_adapter_path
from vserve.core.request import Request


class LoRARegistry:
    def __init__(self, enabled: bool, max_lora_rank: int, model_config=None, download_dir: str | None = None,
                 token: str | None = None) -> None:
        self.enabled, self.max_lora_rank, self.model_config = enabled, max_lora_rank, model_config
        self.download_dir, self.token = download_dir, token  # for adapters given by hub id
        self.by_name: dict[str, LoRARequest] = {}
        self.by_id: dict[int, LoRARequest] = {}  # every adapter checked (added by name or seen in a request)
        self.local: dict[int, LoRARequest] = {}  # the same with its local folder (hub ids resolved)

    @classmethod
    def for_config(cls, config, model_config) -> LoRARegistry:
        return cls(config.enable_lora, config.max_lora_rank, model_config, config.download_dir, config.hf_token)

    def _require(self) -> None:
        if not self.enabled:
            raise ValueError("LoRA adapters need an engine started with --enable-lora (enable_lora=True)")

    def _check(self, lr: LoRARequest) -> LoRARequest:
        known = self.by_id.get(lr.lora_int_id)
        if known is not None:
            if known != lr:
                raise ValueError(f"lora_int_id {lr.lora_int_id} is already adapter {known.lora_name!r} at "
                                 f"{known.lora_path!r}; each adapter needs an id of its own")
            return self.local[lr.lora_int_id]
        local = replace(lr, lora_path=resolve_adapter_path(lr.lora_path, self.download_dir, self.token))
        inspect_adapter(local.lora_path, self.max_lora_rank, self.model_config)
        self.by_id[lr.lora_int_id], self.local[lr.lora_int_id] = lr, local
        return local

    def add(self, name: str, path: str) -> LoRARequest:
        """Check and name an adapter folder (ValueError for a bad one, or a name in use); nothing loads yet."""
        self._require()
        if not isinstance(name, str) or not name:
            raise ValueError("a LoRA adapter's name must be a non-empty string")
        if name in self.by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        lr = self._check(LoRARequest(name, max(self.by_id, default=0) + 1, str(path)))
        self.by_name[name] = lr
        return lr

    def remove(self, name: str) -> LoRARequest:
        lr = self.by_name.pop(name, None)
        if lr is None:
            raise ValueError(f"no LoRA adapter named {name!r} (loaded: {', '.join(self.by_name) or 'none'})")
        del self.by_id[lr.lora_int_id], self.local[lr.lora_int_id]
        return lr

    def resolve(self, lora_request: LoRARequest | None = None, lora_adapter: str | None = None) -> LoRARequest | None:
        """A request's adapter: a LoRARequest (checked once per id) or an added adapter's name; None: the base."""
        if lora_request is None and lora_adapter is None:
            return None
        self._require()
        if lora_request is not None:
            if lora_adapter is not None:
                raise ValueError("pass lora_request or lora_adapter, not both")
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
            return self._check(lora_request)
        lr = self.by_name.get(lora_adapter)
        if lr is None:
            raise ValueError(f"no LoRA adapter named {lora_adapter!r} (loaded: {', '.join(self.by_name) or 'none'})")
        return lr


def set_adapter(children: list[Request], lr: LoRARequest | None) -> list[Request]:
    if lr is not None:
        for r in children:
            r.lora_id, r.lora_name, r.lora_path = lr.lora_int_id, lr.lora_name, lr.lora_path
    return children
