"""The ``epp sim`` command line: its parser and what the parsed options mean.

:func:`build_parser` (defaults from :class:`~epp.sim.config.SimConfig`),
:func:`config_from_args` (the :class:`SimConfig`) and :func:`topology_from_args` (the
pod's own topology and its peers' for KV-transfer pricing). Nothing here starts a
server (:mod:`epp.sim.server` does), so a tool that only needs the configuration the
pods would run with (``epp bench``) can use these without the HTTP stack.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from epp.kvcache.hashing import ALGORITHMS
from epp.sim.config import (
    DEFAULT_MODEL,
    ENCODE_FAILURE_MODES,
    PREFILL_FAILURE_MODES,
    ROLES,
    SimConfig,
)
from epp.sim.kvevents import KVEventsConfig, parse_kv_events_config
from epp.sim.tokens import SimTokenizer, load_tokenizer
from epp.sim.topology import LEVELS, PeerTopology, parse_level_costs, parse_topology

__all__ = [
    "build_parser",
    "config_from_args",
    "kv_events_from_args",
    "tokenizer_from_args",
    "topology_from_args",
]


def build_parser() -> argparse.ArgumentParser:
    """The ``epp sim`` argument parser (defaults from :class:`SimConfig`)."""
    d = SimConfig()
    p = argparse.ArgumentParser(
        prog="epp sim",
        description="vLLM-like OpenAI-compatible model-server simulator: one simulated pod "
        "per --port, each with its own engine (continuous batching, chunked prefill, prefix "
        "cache, LoRA slots). Durations are model milliseconds, multiplied by --time-scale. "
        "See docs/simulator.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--port", type=int, action="append", required=True,
        help="port to serve a simulated pod on (repeatable)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--model", default=DEFAULT_MODEL, help="served base model name")
    p.add_argument("--role", choices=ROLES, default=d.role,
                   help="prefill: answer with 1 token (P/D prefill pod); decode: llm-d's "
                   "decode sidecar (x-prefiller-host-port, x-encoder-hosts-ports) and price "
                   "prompts with kv_transfer_params.do_remote_prefill as KV transfer; "
                   "encode: encoder-only pod (E/P/D), 1 token and ec_transfer_params")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random source")
    p.add_argument("--delay-s", type=float, default=0.0,
                   help="extra latency before every POST reaches the engine (seconds)")  # fmt: skip
    g = p.add_argument_group("batching and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most sequences running at once; the rest wait")  # fmt: skip
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget per engine step (decode tokens + prefill chunks)")  # fmt: skip
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks,
                   help="KV cache capacity in blocks (running sequences + prefix cache)")  # fmt: skip
    g.add_argument("--prefix-caching-hash-algo", choices=ALGORITHMS,
                   default=d.prefix_caching_hash_algo,
                   help="vLLM's block-hash algorithm (block identity and KV events)")  # fmt: skip
    g.add_argument("--hash-seed", default=None, metavar="SEED",
                   help="seed of the first block hash, as vLLM's PYTHONHASHSEED (default: "
                   f"$PYTHONHASHSEED, else {d.hash_seed!r})")  # fmt: skip
    g = p.add_argument_group("KV events and tokenization (docs/simulator.md)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="vLLM's --kv-events-config, e.g. '{\"enable_kv_cache_events\": true, "
                   "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}': publish KV "
                   "events over ZMQ; the n-th --port's pod uses the endpoint ports + n")  # fmt: skip
    g.add_argument("--kv-events-port-offset", type=int, default=None, metavar="N",
                   help="instead: the pod on HTTP port P publishes on port P+N (the replay "
                   "port keeps its distance to the endpoint's)")  # fmt: skip
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a Hugging Face tokenizer.json (or its directory, with "
                   "tokenizer_config.json's chat_template) instead of whitespace words")  # fmt: skip
    g = p.add_argument_group("step cost (model milliseconds)")
    g.add_argument("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token,
                   help="cost per uncached prompt token")  # fmt: skip
    g.add_argument("--decode-base-ms", type=float, default=d.decode_base_ms,
                   help="fixed cost of a step that decodes")  # fmt: skip
    g.add_argument("--decode-per-seq-ms", type=float, default=d.decode_per_seq_ms,
                   help="extra cost per decoding sequence in a step")  # fmt: skip
    g.add_argument("--kv-transfer-ms-per-token", type=float, default=d.kv_transfer_ms_per_token,
                   help="decode role: cost per prompt token pulled from a prefill pod whose "
                   "distance is unknown")  # fmt: skip
    g.add_argument("--encode-ms-per-image", type=float, default=d.encode_ms_per_image,
                   help="cost per multimodal item (image_url, audio_url, video_url, "
                   "input_audio part) a pod encodes: on an encode pod, or on a pod that "
                   "prefills without ec_transfer_params")  # fmt: skip
    g = p.add_argument_group("P/D and E/P/D disaggregation (decode role; see "
                             "docs/disaggregation.md)")
    g.add_argument("--kv-transfer-cost", action="append", default=[],
                   metavar="LEVEL=MS[,LEVEL=MS...]",
                   help="KV-transfer cost per token by the prefill pod's distance: node, "
                   "rack, block, zone or other (repeatable; default "
                   + ",".join(f"{k}={v:g}" for k, v in d.kv_transfer_ms_per_token_by_level)
                   + ")")  # fmt: skip
    g.add_argument("--topology", default="", metavar="LEVEL=VALUE[,...]",
                   help="this pod's topology, e.g. node=n1,rack=r1,block=b1,zone=z1 (default: "
                   "its entry in --peer-topology-file)")  # fmt: skip
    g.add_argument("--peer-topology-file", default=None, metavar="FILE",
                   help="the endpoints file `epp serve --endpoints-file` reads (labels, "
                   "nodeName, nodes: labels); gives each prefill pod's topology, and this "
                   "pod's own when --topology is not given; re-read when it changes")  # fmt: skip
    g.add_argument("--topology-label", action="append", default=[], metavar="LEVEL=KEY",
                   help="label key of a level in --peer-topology-file (defaults: "
                   "node=kubernetes.io/hostname (else nodeName), "
                   "rack=topology.kubernetes.io/rack, block=topology.kubernetes.io/block, "
                   "zone=topology.kubernetes.io/zone)")  # fmt: skip
    g.add_argument("--prefill-failure", choices=PREFILL_FAILURE_MODES, default=d.prefill_failure,
                   help="when the prefill pod fails: prefill locally (fallback), or return "
                   "its status as llm-d's sidecar does (error)")  # fmt: skip
    g.add_argument("--prefill-timeout-s", type=float, default=d.prefill_timeout_s,
                   help="give up on the prefill pod (or an encode pod) after this long "
                   "(wall-clock seconds)")  # fmt: skip
    g.add_argument("--encode-failure", choices=ENCODE_FAILURE_MODES, default=d.encode_failure,
                   help="when an encode pod of x-encoder-hosts-ports fails: answer 502 as "
                   "llm-d's sidecar does (error), or encode locally (fallback)")  # fmt: skip
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora", action="append", default=[], metavar="NAME[,NAME...]",
                   help="LoRA adapter served besides the base model (repeatable)")  # fmt: skip
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="adapter slots (distinct adapters running at once)")  # fmt: skip
    g.add_argument("--lora-load-ms", type=float, default=d.lora_load_ms,
                   help="added to a step per adapter loaded in it")  # fmt: skip
    g = p.add_argument_group("failure injection and time")
    g.add_argument("--error-rate", type=float, default=d.error_rate,
                   help="probability that a valid request gets a 500")  # fmt: skip
    g.add_argument("--slow-start-s", type=float, default=d.slow_start_s,
                   help="after start, /health is 503 and steps are slower for this long "
                   "(seconds, scaled by --time-scale)")  # fmt: skip
    g.add_argument("--slow-start-factor", type=float, default=d.slow_start_factor,
                   help="step-time multiplier during slow start")  # fmt: skip
    g.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="multiplies every modeled duration (0: no waiting at all)")  # fmt: skip
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The :class:`SimConfig` of parsed ``epp sim`` arguments; ValueError if invalid."""
    loras = tuple(n.strip() for arg in args.lora for n in arg.split(",") if n.strip())
    by_level = dict(SimConfig().kv_transfer_ms_per_token_by_level)
    for arg in getattr(args, "kv_transfer_cost", []):
        by_level.update(parse_level_costs(arg))
    return SimConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        prefix_caching_hash_algo=getattr(args, "prefix_caching_hash_algo",
                                         SimConfig().prefix_caching_hash_algo),
        hash_seed=_hash_seed(getattr(args, "hash_seed", None)),
        prefill_ms_per_token=args.prefill_ms_per_token,
        decode_base_ms=args.decode_base_ms,
        decode_per_seq_ms=args.decode_per_seq_ms,
        kv_transfer_ms_per_token=args.kv_transfer_ms_per_token,
        kv_transfer_ms_per_token_by_level=tuple(by_level.items()),
        encode_ms_per_image=getattr(args, "encode_ms_per_image",
                                    SimConfig().encode_ms_per_image),
        prefill_failure=args.prefill_failure,
        encode_failure=getattr(args, "encode_failure", SimConfig().encode_failure),
        prefill_timeout_s=args.prefill_timeout_s,
        loras=loras,
        max_loras=args.max_loras,
        lora_load_ms=args.lora_load_ms,
        role=args.role,
        error_rate=args.error_rate,
        slow_start_s=args.slow_start_s,
        slow_start_factor=args.slow_start_factor,
        time_scale=args.time_scale,
        seed=args.seed,
    )


def _hash_seed(arg: str | None) -> str:
    if arg is not None:
        return arg
    return os.environ.get("PYTHONHASHSEED") or SimConfig().hash_seed


def kv_events_from_args(args: argparse.Namespace) -> KVEventsConfig:
    """``--kv-events-config`` (events off when absent); ValueError if invalid."""
    text = getattr(args, "kv_events_config", None)
    cfg = KVEventsConfig() if text is None else parse_kv_events_config(text)
    if getattr(args, "kv_events_port_offset", None) is not None and not cfg.enabled:
        raise ValueError("--kv-events-port-offset needs --kv-events-config with "
                         "enable_kv_cache_events true")
    return cfg


def tokenizer_from_args(args: argparse.Namespace) -> SimTokenizer:
    """``--tokenizer`` loaded (whitespace words without it); ValueError if it cannot be."""
    return load_tokenizer(getattr(args, "tokenizer", None))


def topology_from_args(
    args: argparse.Namespace,
) -> tuple[dict[str, str] | None, PeerTopology | None]:
    """``--topology`` and ``--peer-topology-file`` / ``--topology-label``; ValueError if
    invalid (the file must exist and parse at startup)."""
    topology = parse_topology(args.topology) if args.topology else None
    keys: dict[str, str] = {}
    for item in args.topology_label:
        level, sep, key = item.partition("=")
        if not sep or level.strip() not in LEVELS or not key.strip():
            raise ValueError(f"--topology-label {item!r}: expected LEVEL=KEY with LEVEL one of "
                             f"{', '.join(LEVELS)}")
        keys[level.strip()] = key.strip()
    if args.peer_topology_file is None:
        if keys:
            raise ValueError("--topology-label needs --peer-topology-file")
        return topology, None
    return topology, PeerTopology(Path(args.peer_topology_file), keys)
