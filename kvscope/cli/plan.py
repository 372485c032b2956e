"""``kvscope plan``: argument parsing, error mapping (exit 2 with the known names), the verdict's exit status
(3: does not fit) and output (rich or JSON)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from kvscope.common.cli_help import HelpFormatter
from kvscope.plan.devices import CPU, Device, get_device
from kvscope.plan.model_files import read_model
from kvscope.plan.planner import DEFAULT_MAX_NUM_BATCHED_TOKENS, Plan, PlanRequest, plan
from kvscope.plan.request import DTYPES, QUANTIZATIONS

DOES_NOT_FIT = 3
"""Exit status when the model does not fit as asked (0: it fits; 2: bad input; 1: a log source that cannot be
read)."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``"536870912"``, ``"512M"``, ``"1GiB"`` (binary units, as ``kvscope engine
    --kv-cache-memory``)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 268435456, 256M, 1GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvscope plan",
        description="KV-cache capacity planner: memory, concurrency, "
        "speed envelope and engine flags for a model on a device (docs/plan.md).\n"
        f"Exit status: 0 the model fits, {DOES_NOT_FIT} it does not (the verdict says by how much and what "
        "would fit), 2 bad input, 1 a log source that cannot be read.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="registered name, HF folder, config.json or .gguf")
    p.add_argument(
        "--device",
        default=CPU,
        help="device table name (h100-80gb, a100-40gb, l4 …) or cpu "
        "(measured by a short probe); --list-devices shows them",
    )
    p.add_argument("--list-devices", action="store_true", help="print the device table and exit")
    p.add_argument(
        "--wide",
        action="store_true",
        help="--list-devices: every column, however wide (the table fits the terminal by leaving out the "
        "sources, vendors and aliases; a pipe or a file gets every column)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="auto: on a GPU the config's torch_dtype (bfloat16 for a float32 checkpoint, float16 where the "
        "device has no bfloat16), on the CPU the faster of float32/bfloat16 by the probe, as the engine",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="auto: none on a GPU; on the CPU what kvscope serve runs (gguf for a model verified in it, else "
        "dense). int8/int4 on the CPU are the kvscope engine's formats",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs of --device the model is split over (vLLM's flag: the recommended command is then "
        "vllm serve)",
    )
    p.add_argument(
        "--weights-format",
        choices=("float32", "bfloat16", "int8", "int4", "gguf"),
        help="the kvscope engine's CPU weight format: weights counted as the engine holds them "
        "(compact formats: --dtype is their dense dtype), flags name --dtype/--quantization",
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16", "fp8")
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="context length (default: the model's, lowered to what fits, never below the workload's "
        "--prompt-len + --output-len)",
    )
    p.add_argument("--concurrency", type=int, help="sequences that must fit at max_model_len (default 1)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of device memory (the CPU: of RAM) for weights and KV cache",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        help="CPU KV budget (e.g. 1GiB) (default: the usable memory the weights leave)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--prompt-len", type=int, default=128, help="workload prompt tokens (speed rows)")
    p.add_argument("--output-len", type=int, default=128, help="workload output tokens (speed rows)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="the engine's prefill token budget per step (default: the engine's, %(default)s)",
    )
    p.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT SLO in seconds")
    p.add_argument(
        "--from-log",
        metavar="PATH_OR_URL",
        help="replay a gateway request log: JSONL file or folder, or an Elasticsearch URL",
    )
    es = p.add_argument_group("Elasticsearch (--from-log http(s)://…; defaults from ELASTICSEARCH_*)")
    es.add_argument(
        "--index", default="kvscope-requests", help="data stream / index (default kvscope-requests)"
    )
    es.add_argument("--api-key")
    es.add_argument("--user")
    es.add_argument("--password")
    es.add_argument("--ca-certs")
    es.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")
    p.add_argument(
        "--probe-threads", type=int, help="cpu: torch threads of the probe (default: the engine's)"
    )
    p.add_argument(
        "--probe-bytes", type=parse_size, default=1 << 30, help="cpu: bandwidth buffer (default 1GiB)"
    )
    p.add_argument("--format", default="table", choices=("table", "json"))
    return p


def _request(args: argparse.Namespace) -> PlanRequest:
    return PlanRequest(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        concurrency=args.concurrency,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        ttft_slo_s=args.ttft_slo,
        weights_format=args.weights_format,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def resolve_device(name: str, args: argparse.Namespace) -> Device:
    """The table entry, or this machine's CPU measured now. Raises UnknownDeviceError naming the known
    ones."""
    if name.lower() != CPU:
        return get_device(name)
    from kvscope.plan.cpu_probe import ProbeConfig, probe_cpu

    return probe_cpu(ProbeConfig(threads=args.probe_threads, buffer_bytes=args.probe_bytes))


def make_plan(args: argparse.Namespace) -> Plan:
    """Validate, read the model, resolve the device (model first: a bad name costs no probe), plan, replay."""
    req = _request(args)
    files = read_model(req.model)
    if req.device.lower() != CPU:
        get_device(req.device)
    spans_meta = _read_log(args) if args.from_log else None
    device = resolve_device(req.device, args)
    result = plan(req, files, device)
    if not result.fits:
        from dataclasses import replace

        from kvscope.plan.advice import alternatives

        result = replace(
            result, verdict=result.verdict | {"alternatives": alternatives(result, files, device)}
        )
    if spans_meta is None:
        return result
    from kvscope.plan.log_section import with_log
    from kvscope.plan.planner import aggregate

    planned = PlanRequest(**result.request)  # dtype and formats decided, as the plan used them
    devices = aggregate(device, planned.tensor_parallel_size)
    return with_log(result, planned, files.shape, spans_meta[0], args.from_log, spans_meta[1], devices)


def _read_log(args: argparse.Namespace):
    if not args.from_log.startswith(("http://", "https://")):
        from kvscope.cli.plan_log import read_spans

        return read_spans(args.from_log)
    import asyncio

    return asyncio.run(_read_es(args))


async def _read_es(args: argparse.Namespace):
    """Spans from Elasticsearch. Raises RuntimeError (exit 1) when the cluster cannot be read."""
    from elastic_transport import TransportError
    from elasticsearch import ApiError

    from kvscope.cli.plan_env import es_env
    from kvscope.gateway.logs.es_client import EsConnectionConfig, make_client
    from kvscope.plan.replay_es import read_spans_es

    env = es_env()
    user = args.user or env.username
    basic = (user, args.password or env.password or "") if user else None
    client = make_client(
        EsConnectionConfig(
            hosts=(args.from_log,),
            api_key=args.api_key or env.api_key,
            basic_auth=basic,
            ca_certs=args.ca_certs or env.ca_certs,
            verify_certs=not args.insecure,
        ),
        max_retries=3,
    )
    try:
        return await read_spans_es(client, args.index)
    except (TransportError, ApiError) as exc:
        raise RuntimeError(f"cannot read {args.index} at {args.from_log}: {exc}") from exc
    finally:
        await client.close()


def plan_main(argv: list[str]) -> int:
    """``kvscope plan`` entry point. Exit 0 when the model fits, :data:`DOES_NOT_FIT` when it does not (the
    plan is printed all the same, with the verdict and the alternatives); 2 with a message on stderr for bad
    input (unknown model or device — the message names the known ones —, a missing log, an impossible
    setting); 1 when an Elasticsearch log source cannot be read."""
    args = build_parser().parse_args(argv)
    if args.list_devices:
        from kvscope.plan.render import devices_json, print_devices

        if args.format == "json":
            print(json.dumps(devices_json(), indent=2))
        else:
            from kvscope.common.tables import terminal_width

            print_devices(sys.stdout, None if args.wide else terminal_width(sys.stdout))
        return 0
    try:
        result = make_plan(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvscope plan: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"kvscope plan: error: {exc}", file=sys.stderr)
        return 1
    if args.format == "json":
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        from kvscope.plan.render import print_plan

        print_plan(result)
    return 0 if result.fits else DOES_NOT_FIT
