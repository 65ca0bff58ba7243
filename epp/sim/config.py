"""Parameters of one simulated model server (docs/simulator.md explains each one).

:class:`SimConfig` is immutable and validated on construction: an invalid value raises
:class:`ValueError` naming the parameter. Every duration in it is *model* time; the
engine multiplies each by :attr:`SimConfig.time_scale` before sleeping.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

_DISTANCES: Final = ("node", "rack", "block", "zone", "other")  # epp.sim.topology.DISTANCES
_HASH_ALGOS: Final = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")  # epp.kvcache.hashing

__all__ = [
    "DEFAULT_KV_TRANSFER_BY_LEVEL",
    "DEFAULT_MODEL",
    "ENCODE_FAILURE_MODES",
    "PREFILL_FAILURE_MODES",
    "ROLES",
    "PrefillFailure",
    "Role",
    "SimConfig",
]

DEFAULT_MODEL: Final = "sim-model"
"""The base model a simulated pod serves unless told otherwise (``epp sim --model``)."""

Role = Literal["both", "prefill", "decode", "encode"]
ROLES: Final[tuple[Role, ...]] = ("both", "prefill", "decode", "encode")
PrefillFailure = Literal["fallback", "error"]
PREFILL_FAILURE_MODES: Final[tuple[PrefillFailure, ...]] = ("fallback", "error")
ENCODE_FAILURE_MODES: Final[tuple[PrefillFailure, ...]] = ("error", "fallback")
DEFAULT_KV_TRANSFER_BY_LEVEL: Final[tuple[tuple[str, float], ...]] = (
    ("node", 0.0002),
    ("rack", 0.0005),
    ("block", 0.001),
    ("zone", 0.002),
    ("other", 0.004),
)
"""Decode role: KV-transfer cost per token by the prefill peer's distance
(:func:`epp.sim.topology.distance`); ``rack`` equals the default
``kv_transfer_ms_per_token``."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Latency model, cache, LoRA, role and failure-injection parameters.

    The default costs and KV pool are calibrated to Llama 3.1 8B (BF16) served by vLLM on
    one H100 80GB, one simulator token standing for one model token (docs/simulator.md,
    "Calibration"); ``time_scale`` speeds every duration up or down alike.
    """

    # Continuous batching.
    max_num_seqs: int = 256
    """Most sequences in the running batch; the rest wait (``num_requests_waiting``)."""
    max_num_batched_tokens: int = 8192
    """Token budget of one engine step: one per decoding sequence plus prefill chunks."""
    # KV cache.
    block_size: int = 16
    """Tokens per KV block (the prefix-cache granularity)."""
    num_gpu_blocks: int = 24576
    """KV cache capacity in blocks, shared by running sequences and the prefix cache
    (393,216 tokens: ~48 GiB of KV at 128 KiB per token, what an H100 80GB has left
    after Llama 3.1 8B's weights)."""
    prefix_caching_hash_algo: str = "sha256_cbor"
    """vLLM's ``--prefix-caching-hash-algo`` for block hashes: ``sha256``,
    ``sha256_cbor``, ``xxhash`` or ``xxhash_cbor`` (:mod:`epp.kvcache.hashing`)."""
    hash_seed: str = "0"
    """The NONE_HASH seed (vLLM's ``PYTHONHASHSEED``) that starts every block-hash chain."""
    # Step cost.
    prefill_ms_per_token: float = 0.04
    """Cost of one *uncached* prompt token in a step (25,000 prompt tokens/s)."""
    decode_base_ms: float = 6.5
    """Fixed cost of a step that decodes at least one sequence."""
    decode_per_seq_ms: float = 0.06
    """Extra decode cost per sequence decoded in the step."""
    kv_transfer_ms_per_token: float = 0.0005
    """Decode role: cost per uncached prompt token whose KV comes from a prefill pod, when
    the prefill pod's distance is unknown (see ``kv_transfer_ms_per_token_by_level``)."""
    kv_transfer_ms_per_token_by_level: tuple[tuple[str, float], ...] = (
        DEFAULT_KV_TRANSFER_BY_LEVEL
    )
    """Decode role: the same cost by the distance to the prefill pod (``node``, ``rack``,
    ``block``, ``zone``, ``other``); a level not listed costs ``kv_transfer_ms_per_token``."""
    encode_ms_per_image: float = 12.0
    """Cost of encoding one multimodal item of a chat request (an ``image_url``,
    ``audio_url``, ``video_url`` or ``input_audio`` part; repeated URLs count once), added
    to the engine step that admits the request: on an ``encode``-role pod always, on any
    other pod only when it prefills the request itself and no encode pod did the work
    (a vision encoder of a 7B VLM on one H100, ~1k-patch image)."""
    # LoRA.
    loras: tuple[str, ...] = ()
    """Adapter names served besides the base model (a request selects one by ``model``)."""
    max_loras: int = 1
    """Adapter slots: most distinct adapters loaded (and so running) at once."""
    lora_load_ms: float = 5.0
    """Added to a step for each adapter loaded into a slot in it."""
    # Role.
    role: Role = "both"
    """``prefill`` answers every generation with one token; ``decode`` acts as llm-d's
    decode sidecar for requests naming a prefill pod in ``x-prefiller-host-port`` and
    encode pods in ``x-encoder-hosts-ports``; ``encode`` is an encoder-only pod (vLLM
    ``--mm-encoder-only``): one token, the items priced at ``encode_ms_per_image``,
    ``ec_transfer_params`` in the answer."""
    prefill_failure: PrefillFailure = "fallback"
    """Decode role, when the prefill pod fails or cannot be reached: ``fallback`` prefills
    locally; ``error`` returns the prefill pod's status (502 if unreachable), as llm-d's
    nixlv2 sidecar does."""
    prefill_timeout_s: float = 60.0
    """Decode role: give up on the prefill pod (and on an encode pod) after this many
    wall-clock seconds."""
    encode_failure: PrefillFailure = "error"
    """Decode role, when an encode pod named in ``x-encoder-hosts-ports`` fails or cannot
    be reached: ``error`` answers 502, as llm-d's sidecar does; ``fallback`` encodes the
    items locally (priced at ``encode_ms_per_image``)."""
    # Failure injection.
    error_rate: float = 0.0
    """Probability (0..1) that a valid generation request gets a 500."""
    slow_start_s: float = 0.0
    """For this long after start, ``/health`` is 503 and steps are slower."""
    slow_start_factor: float = 3.0
    """Step-time multiplier during slow start."""
    # Global.
    time_scale: float = 1.0
    """Multiplies every modeled duration (0 = as fast as the event loop goes)."""
    seed: int = 0
    """Seeds the per-server random source (error injection)."""

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

        def non_negative(name: str) -> None:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks"):
            positive(name)
        for name in (
            "prefill_ms_per_token",
            "decode_base_ms",
            "decode_per_seq_ms",
            "kv_transfer_ms_per_token",
            "encode_ms_per_image",
            "max_loras",
            "lora_load_ms",
            "slow_start_s",
            "time_scale",
        ):
            non_negative(name)
        if self.prefix_caching_hash_algo not in _HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(_HASH_ALGOS)}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        if self.prefill_timeout_s <= 0:
            raise ValueError(f"prefill_timeout_s must be > 0, got {self.prefill_timeout_s}")
        if self.prefill_failure not in PREFILL_FAILURE_MODES:
            raise ValueError(f"prefill_failure must be one of {', '.join(PREFILL_FAILURE_MODES)}, "
                             f"got {self.prefill_failure!r}")
        if self.encode_failure not in ENCODE_FAILURE_MODES:
            raise ValueError(f"encode_failure must be one of {', '.join(ENCODE_FAILURE_MODES)}, "
                             f"got {self.encode_failure!r}")
        levels = [lvl for lvl, _ in self.kv_transfer_ms_per_token_by_level]
        if len(set(levels)) != len(levels) or not set(levels) <= set(_DISTANCES):
            raise ValueError("kv_transfer_ms_per_token_by_level: levels must be distinct, among "
                             f"{', '.join(_DISTANCES)}; got {levels}")
        if any(cost < 0 for _, cost in self.kv_transfer_ms_per_token_by_level):
            raise ValueError("kv_transfer_ms_per_token_by_level: costs must be >= 0")
        if self.slow_start_factor < 1:
            raise ValueError(f"slow_start_factor must be >= 1, got {self.slow_start_factor}")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {self.error_rate}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.loras and self.max_loras < 1:
            raise ValueError("max_loras must be >= 1 when LoRA adapters are configured")
        if len(set(self.loras)) != len(self.loras) or any(not n for n in self.loras):
            raise ValueError(f"loras must be distinct non-empty names, got {list(self.loras)}")

    def transfer_cost(self, level: str | None) -> float:
        """KV-transfer cost per token for a prefill peer at distance ``level`` (None:
        unknown)."""
        for lvl, cost in self.kv_transfer_ms_per_token_by_level:
            if lvl == level:
                return cost
        return self.kv_transfer_ms_per_token

    def as_dict(self) -> dict[str, Any]:
        """The parameters as plain JSON-able values."""
        d = asdict(self)
        d["loras"] = list(self.loras)
        d["kv_transfer_ms_per_token_by_level"] = dict(self.kv_transfer_ms_per_token_by_level)
        return d
