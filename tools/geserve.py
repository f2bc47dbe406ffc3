"""geserve: serve a trace of requests with a Hugging Face causal LM on the simulated NPU (geir.frontends.torch.serve).

    geserve TRACE.jsonl --model CONFIG.json [--policy continuous|static] [--block-size N]
            [--pool-bytes B | --memory-utilization F]
            [--launch single-op|graph] [--timing-only] [--seed N] [--target NAME] [--json] [--trace OUT.json]

TRACE.jsonl holds one request per line, a JSON object:
    {"prompt_ids": [15, 4, 92], "max_new_tokens": 16, "arrival_us": 250.0}
`prompt_ids`: at least 2 token ids below the model's vocabulary size; `max_new_tokens`: at least 1;
`arrival_us`: when the request arrives on the modelled clock (microseconds, >= 0; 0 when absent). Blank
lines are skipped.

CONFIG.json is a transformers config as a JSON object with its "model_type" (e.g. "llama", "gpt2"); the
model is initialised at random from --seed. Every request is generated greedily; the tool prints one row
per request (TTFT, TPOT, latency on the modelled clock, preemptions) and the run's figures (throughput,
KV pool bytes, utilisation and waste, plan-cache hits, host GE time, device idle time), or all of it as
JSON with --json.

Exit codes: 0 success, 1 bad input (unreadable file, bad JSON, a field of the wrong kind, a request that can
never fit the KV pool: FILE:LINE:COL: error: with a caret), 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from geir.diagnostics import Diagnostic, DiagnosticError, Location, SourceManager
from geir.tools.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    DiagnosticPrinter,
    ToolError,
    add_target_options,
    add_version,
    check_target,
    non_negative,
    read_input,
    refuse_overwrites,
    refuse_unwritable,
    run_tool,
    write_atomically,
)

TOOL = "geserve"


def _positive(text: str) -> int:
    """argparse type of a size: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {value}")
    return value


def _share(text: str) -> float:
    """argparse type of a share of the device's memory: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], not '{text}'") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], not {text}")
    return value


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=TOOL, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a trace of requests with a Hugging Face causal LM (random init) on the simulated NPU: "
                    "continuous or static batching over a KV block pool, every time on the modelled clock.",
        epilog="TRACE.jsonl: one JSON object a line, {\"prompt_ids\": [ids...], \"max_new_tokens\": n, "
               "\"arrival_us\": t}\n(prompt of at least 2 ids below the vocabulary size, n >= 1, t >= 0 "
               "microseconds, 0 when absent).\nCONFIG.json: a transformers config dict with \"model_type\".")
    add_version(p, TOOL)
    p.add_argument("requests", metavar="TRACE.jsonl", help="the requests, one JSON object a line (see below)")
    p.add_argument("--model", required=True, metavar="CONFIG.json",
                   help="a transformers config as JSON, with \"model_type\" (weights: random from --seed)")
    p.add_argument("--policy", choices=("continuous", "static"), default="continuous",
                   help="iteration-level (continuous) batching, or static batches run to their end "
                        "(default continuous)")
    p.add_argument("--block-size", type=_positive, default=128, metavar="N",
                   help="tokens per KV block (default 128, as on Ascend; a block times the head dim at most 128 x 128, "
                        "one cube tile)")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--pool-bytes", type=_positive, metavar="B",
                      help="the KV pool's device bytes (default: every request at its longest at once)")
    pool.add_argument("--memory-utilization", type=_share, metavar="F",
                      help="size the pool as vLLM's gpu_memory_utilization does: what this share of the target's "
                           "device memory leaves after the weights, the step's inputs and the largest activation "
                           "arena GE plans")
    p.add_argument("--launch", choices=("single-op", "graph"), default="single-op",
                   help="how a step's kernels reach the device: the host submits each (single-op), or the step's task "
                        "graph is captured once per GE bucket and replayed by one submission (graph, as ACL Graph)")
    p.add_argument("--timing-only", action="store_true",
                   help="time every run with the kernels' cost models and skip the arithmetic: the same schedule "
                        "and device times; the new tokens are unknown (-1)")
    p.add_argument("--seed", type=non_negative, default=0, metavar="N", help="the weights' random seed (default 0)")
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="print the run as JSON: its figures, each request, each step")
    p.add_argument("--trace", dest="chrome_trace", metavar="TRACE.json",
                   help="write a Chrome trace of the run (atomically): GE's host work, the device's runs with the KV "
                        "pool's blocks as a counter, a track per request")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_tool(TOOL, run, build_arg_parser().parse_args(argv))


class _BadInput(Exception):
    """A diagnostic about an input file, printed with its caret."""

    def __init__(self, diag: Diagnostic):
        super().__init__(diag.message)
        self.diag = diag


def _text(path: str) -> tuple[str, str]:
    """A file's name and text; ToolError when it cannot be read or is not UTF-8."""
    name, data = read_input(path)
    try:
        return name, data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ToolError(f"{name}: not UTF-8 text (byte {e.start})") from None


def _key_column(line: str, key: str) -> int:
    """The column (1-based) where `"key"` is written on the line, else 1."""
    m = re.search(rf'"{re.escape(key)}"\s*:', line)
    return m.start() + 1 if m else 1


def _error(file: str, line: int, col: int, message: str) -> _BadInput:
    return _BadInput(Diagnostic("error", message, Location(file, line, col)))


def _json_object(name: str, line_no: int, line: str) -> dict[str, Any]:
    """One JSON object; _BadInput at the place the JSON breaks, or when it is no object."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        line_at = line_no + e.lineno - 1
        raise _error(name, line_at, e.colno, f"invalid JSON: {e.msg}") from None
    except ValueError as e:  # JSON Python will not read: an integer of more digits than int() converts
        raise _error(name, line_no, 1, f"invalid JSON: {e}") from None
    if not isinstance(value, dict):
        raise _error(name, line_no, 1, f"expected a JSON object, not {type(value).__name__}")
    return value


def read_trace(name: str, text: str, vocab: int) -> tuple[list[tuple[list[int], int, float]], list[int]]:
    """The requests of a JSONL trace and the line each is on; _BadInput naming the line and field."""
    requests, lines = [], []
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        obj = _json_object(name, i, line)
        unknown = sorted(set(obj) - {"prompt_ids", "max_new_tokens", "arrival_us"})
        if unknown:
            raise _error(name, i, _key_column(line, unknown[0]), f"unknown field '{unknown[0]}' (a request has "
                                                                  f"prompt_ids, max_new_tokens, arrival_us)")
        for key in ("prompt_ids", "max_new_tokens"):
            if key not in obj:
                raise _error(name, i, 1, f"the request has no '{key}'")
        ids = obj["prompt_ids"]
        at = _key_column(line, "prompt_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise _error(name, i, at, "prompt_ids must be a list of integer token ids")
        if len(ids) < 2:
            raise _error(name, i, at, f"prompt_ids has {len(ids)} token(s): a prompt needs at least 2")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise _error(name, i, at, f"token id {bad[0]} is outside the model's vocabulary (0 to {vocab - 1})")
        new = obj["max_new_tokens"]
        if not isinstance(new, int) or isinstance(new, bool) or new < 1:
            raise _error(name, i, _key_column(line, "max_new_tokens"),
                         f"max_new_tokens must be an integer of at least 1, not {json.dumps(new)}")
        arrival = obj.get("arrival_us", 0)
        if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not arrival >= 0 or arrival == float("inf"):
            raise _error(name, i, _key_column(line, "arrival_us"),
                         f"arrival_us must be a finite number of microseconds >= 0, not {json.dumps(arrival)}")
        requests.append((ids, new, float(arrival)))
        lines.append(i)
    if not requests:
        raise _error(name, 1, 1, "the trace holds no request")
    return requests, lines


def build_model(name: str, text: str, seed: int) -> Any:
    """A causal LM from a transformers config (JSON with model_type), weights random from `seed`."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise _error(name, e.lineno, e.colno, f"invalid JSON: {e.msg}") from None
    except ValueError as e:  # JSON Python will not read: an integer of more digits than int() converts
        raise _error(name, 1, 1, f"invalid JSON: {e}") from None
    if not isinstance(config, dict):
        raise _error(name, 1, 1, f"expected a JSON object (a transformers config), not {type(config).__name__}")
    kind = config.get("model_type")
    line_of = _line_of_key(text, "model_type")
    if not isinstance(kind, str):
        raise _error(name, 1, 1, "the config has no \"model_type\" (e.g. \"llama\", \"gpt2\")")
    import torch
    import transformers

    from transformers import CONFIG_MAPPING

    from geir.runtime.device import host_bytes_available

    if kind not in CONFIG_MAPPING:
        import difflib

        near = difflib.get_close_matches(kind, list(CONFIG_MAPPING.keys()), 1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise _error(name, *line_of, f"transformers has no model_type '{kind}'{hint}")
    try:
        cfg = transformers.AutoConfig.for_model(kind, **{k: v for k, v in config.items() if k != "model_type"})
    except Exception as e:  # noqa: BLE001 - transformers' own validation raises many kinds (its strict dataclasses)
        raise _error(name, *line_of, f"transformers cannot make a '{kind}' config: {_first_line(e)}") from None
    try:  # its size first, on the meta device (no bytes): a config may ask for more weights than the host holds
        with torch.device("meta"):
            shape = transformers.AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # noqa: BLE001 - a model's constructor checks its config with any exception it likes
        raise _error(name, *line_of, f"no causal LM for a '{kind}' config: {_first_line(e)}") from None
    weights = sum(p.numel() * p.element_size() for p in shape.parameters())
    available = host_bytes_available()
    if available is not None and weights > available:
        raise _error(name, *line_of, f"the '{kind}' model this config makes has {weights} B of weights, more than the "
                                     f"{available} B this host has available")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    try:  # a config transformers accepts may still make a model that cannot run (heads that do not divide, ...)
        with torch.no_grad():
            model(torch.zeros((1, 2), dtype=torch.long))
    except Exception as e:  # noqa: BLE001 - whatever the model's forward raises on its own config
        raise _error(name, *line_of, f"the '{kind}' model this config makes cannot run: {_first_line(e)}") from None
    return model


def _first_line(e: BaseException) -> str:
    """An exception's message's first line (or its type where it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _line_of_key(text: str, key: str) -> tuple[int, int]:
    """(line, column) where `"key":` is written in a JSON text, else (1, 1)."""
    for i, line in enumerate(text.split("\n"), 1):
        m = re.search(rf'"{re.escape(key)}"\s*:', line)
        if m:
            return i, m.start() + 1
    return 1, 1


def _limit(cfg: Any) -> int | None:
    """The most positions the model takes, where its config says."""
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _progress_bar():
    """A one-line progress bar on stderr (a terminal only): requests done of all, redrawn in place."""
    def show(done: int, total: int) -> None:
        filled = 30 * done // total
        end = "\n" if done == total else ""
        print(f"\r{TOOL}: [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} requests", end=end, file=sys.stderr,
              flush=True)
    return show


def run(args: argparse.Namespace) -> int:
    chip = check_target(args.target)
    if args.chrome_trace:
        refuse_overwrites([("TRACE.jsonl", args.requests), ("--model", args.model)], [("--trace", args.chrome_trace)])
        refuse_unwritable([("--trace", args.chrome_trace)])
    sources = SourceManager()
    printer = DiagnosticPrinter(sources)
    trace_name, trace_text = _text(args.requests)
    model_name, model_text = _text(args.model)
    sources.add(trace_name, trace_text)
    sources.add(model_name, model_text)
    try:
        model = build_model(model_name, model_text, args.seed)
        requests, lines = read_trace(trace_name, trace_text, model.config.vocab_size)
        limit = _limit(model.config)
        for (ids, new, _), line in zip(requests, lines):
            if limit is not None and len(ids) + new > limit:
                raise _error(trace_name, line, 1, f"the prompt's {len(ids)} tokens and {new} new tokens exceed the "
                                                  f"model's {limit} positions")
        from geir.frontends.torch import TorchImportError, serve
        from geir.runtime.interpreter import RuntimeFailure

        try:
            result = serve(model, requests, policy=args.policy, block_size=args.block_size,
                           pool_bytes=args.pool_bytes, memory_utilization=args.memory_utilization, target=chip,
                           launch=args.launch, timing_only=args.timing_only,
                           progress=_progress_bar() if sys.stderr.isatty() else None)
        except TorchImportError as e:
            raise ToolError(f"{model_name}: GEIR cannot import the model's step programs: {e}") from None
        except RuntimeFailure as e:  # a step the Runtime cannot run (e.g. device bytes the host cannot hold)
            raise ToolError(str(e)) from None
        except DiagnosticError as e:  # GE cannot compile a step (e.g. no tiling fits the model's head dim)
            raise ToolError(f"{model_name}: GE cannot compile the model's step programs: {e}") from None
        except ValueError as e:
            m = re.match(r"request (\d+)[: ]", str(e))
            if m is None:
                raise ToolError(str(e)) from None
            raise _error(trace_name, lines[int(m.group(1))], 1, str(e)) from None
    except _BadInput as e:
        printer(e.diag)
        return EXIT_FAILURE
    if args.chrome_trace:
        write_atomically(args.chrome_trace, json.dumps(result.trace()))
    if args.json:
        print(json.dumps(result.as_dict(), indent=1))
    else:
        print(result.render())
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
