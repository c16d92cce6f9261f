"""Speech benchmark: time to first audio, real-time factor, and how many concurrent streams stay faster than real time.

    python -m omnivox.benchmarks.speech [--model SPEECH_FOLDER | --address HOST:PORT] [--concurrency 1,2,4,8]

Without --address it starts `omnivox serve` on --model (default: the embedded random speech model). At each
concurrency level, that many clients each ask for the same text (LINEAR16, 24 kHz) at once.

Per stream: time to first audio (client side, from sending the request), real-time factor (wall time of the whole
stream / audio seconds) and lateness. A stream *stays faster than real time* when playback that starts with its first
chunk never runs dry: every chunk arrives before the audio received ahead of it has finished playing (lateness <= 0).
The headline number is the highest level at which every stream stayed faster than real time.

`--compare-first-hop N` runs the same levels in the same run against a second server started with
`--speech-first-hop N` (every stream's first chunk N frames, hops doubling: the start before sizing from measured
rates; N = 1 is the earliest first audio), alternating the two servers level by level. Each server first serves one
warm-up stream (not counted): the start is sized from rates it measured on earlier streams. `--repeats R` runs each
level R times; the table gives medians over repeats and how many repeats stayed faster than real time.

`--compare-checkout DIR` does the same against a second server running the code of another checkout of this
repository (e.g. `git worktree add /tmp/omnivox-before <commit>`), same arguments: before/after of a code change in
one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from omnivox.benchmarks.host import write_results

DEFAULT_TEXT = "Hello there! This is a quick test of streaming speech synthesis. How does it sound?"
BYTES_PER_SECOND = 24000 * 2  # LINEAR16 at 24 kHz


@dataclass
class StreamResult:
    ttfa_s: float  # request sent -> first audio bytes received
    wall_s: float  # request sent -> summary received
    audio_s: float
    rtf: float  # wall_s / audio_s
    server_rtf: float  # the summary's real-time factor
    lateness_s: float  # worst (chunk arrival - when playback started at the first chunk would need it); <= 0 is good

    @property
    def realtime(self) -> bool:
        return self.lateness_s <= 0.0


def synthesize_one(
    address: str, text: str, voice: str, model: str, timeout_s: float, seed: int | None = None
) -> StreamResult:
    from omnivox.v1 import content_pb2, speech_pb2, speech_pb2_grpc

    request = speech_pb2.SynthesizeSpeechRequest(
        model=model,
        text=text,
        voice=speech_pb2.VoiceSelection(name=voice),
        audio_config=speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_LINEAR16, sample_rate_hertz=24000),
    )
    if seed is not None:  # the same frames as another synthesis with this seed (a check, not a benchmark, needs it)
        request.sampling.seed = seed
    with grpc.insecure_channel(address) as channel:
        stub = speech_pb2_grpc.SpeechServiceStub(channel)
        start = time.monotonic()
        first: float | None = None
        received_s = 0.0  # audio seconds received before the current chunk
        lateness = float("-inf")
        summary = None
        for response in stub.SynthesizeSpeech(request, timeout=timeout_s):
            now = time.monotonic()
            kind = response.WhichOneof("response")
            if kind == "audio" and response.audio.data:
                if first is None:
                    first = now
                lateness = max(lateness, (now - first) - received_s)
                received_s += len(response.audio.data) / BYTES_PER_SECOND
            elif kind == "summary":
                summary = response.summary
        wall = time.monotonic() - start
    if summary is None or first is None:
        raise RuntimeError("the stream ended without audio or summary")
    audio_s = summary.audio_seconds
    return StreamResult(
        ttfa_s=first - start,
        wall_s=wall,
        audio_s=audio_s,
        rtf=wall / audio_s if audio_s else float("inf"),
        server_rtf=summary.real_time_factor,
        lateness_s=lateness,
    )


def run_level(address: str, n: int, text: str, voice: str = "", model: str = "", timeout_s: float = 600) -> dict:
    """`n` concurrent streams once: their figures."""
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda _: synthesize_one(address, text, voice, model, timeout_s), range(n)))
    ttfa = sorted(r.ttfa_s for r in results)
    return {
        "concurrency": n,
        "ttfa_p50_s": statistics.median(ttfa),
        "ttfa_max_s": ttfa[-1],
        "rtf_p50": statistics.median(r.rtf for r in results),
        "rtf_max": max(r.rtf for r in results),
        "audio_s": statistics.mean(r.audio_s for r in results),
        "worst_lateness_s": max(r.lateness_s for r in results),
        "all_realtime": all(r.realtime for r in results),
        "streams": [asdict(r) | {"realtime": r.realtime} for r in results],
    }


def summarize(n: int, runs: list[dict]) -> dict:
    """A level's repeats: medians of the per-run figures; faster than real time only if every repeat was."""
    if len(runs) == 1:
        return runs[0]
    keys = ("ttfa_p50_s", "ttfa_max_s", "rtf_p50", "rtf_max", "audio_s", "worst_lateness_s")
    return {
        "concurrency": n,
        **{k: statistics.median(r[k] for r in runs) for k in keys},
        "all_realtime": all(r["all_realtime"] for r in runs),
        "realtime_repeats": sum(r["all_realtime"] for r in runs),
        "repeats": runs,
    }


def run_levels(
    address: str,
    levels: list[int],
    text: str = DEFAULT_TEXT,
    voice: str = "",
    model: str = "",
    timeout_s: float = 600,
    repeats: int = 1,
) -> dict:
    """Every level in turn; returns {"levels": [...], "max_realtime_streams": N}."""
    out = [summarize(n, [run_level(address, n, text, voice, model, timeout_s) for _ in range(repeats)]) for n in levels]
    return finish(out)


def finish(levels: list[dict]) -> dict:
    realtime_levels = [level["concurrency"] for level in levels if level["all_realtime"]]
    return {"levels": levels, "max_realtime_streams": max(realtime_levels, default=0)}


def run_compare(
    address: str, before: str, levels: list[int], text: str, voice: str, repeats: int, timeout_s: float = 600
) -> dict:
    """The levels against two servers, alternating level by level and repeat by repeat (load drifts alike)."""
    for a in (address, before):  # warm-up: each server measures its rates on one stream
        run_level(a, 1, text, voice, "", timeout_s)
    runs: dict[str, dict[int, list[dict]]] = {"after": {}, "before": {}}
    for n in levels:
        for _ in range(repeats):
            for name, a in (("before", before), ("after", address)):
                runs[name].setdefault(n, []).append(run_level(a, n, text, voice, "", timeout_s))
    return {name: finish([summarize(n, r[n]) for n in levels]) for name, r in runs.items()}


def format_table(result: dict) -> str:
    if "after" in result:
        return "\n\n".join(f"{name}:\n{format_table(result[name])}" for name in ("before", "after"))
    lines = [
        "| streams | first audio p50 / max (ms) | RTF p50 / max | worst lateness (ms) | all faster than real time |",
        "|---:|---:|---:|---:|:---:|",
    ]
    for level in result["levels"]:
        realtime = "yes" if level["all_realtime"] else "no"
        if "repeats" in level:
            realtime += f" ({level['realtime_repeats']} of {len(level['repeats'])})"
        lines.append(
            f"| {level['concurrency']} | {level['ttfa_p50_s'] * 1e3:.0f} / {level['ttfa_max_s'] * 1e3:.0f} | "
            f"{level['rtf_p50']:.2f} / {level['rtf_max']:.2f} | {max(level['worst_lateness_s'], 0) * 1e3:.0f} | "
            f"{realtime} |"
        )
    lines.append(f"\nconcurrent streams that all stay faster than real time: {result['max_realtime_streams']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m omnivox.benchmarks.speech", description=__doc__.splitlines()[0])
    ap.add_argument("--address", help="an omnivox server already running (else one is started on --model)")
    ap.add_argument("--model", help="speech model folder (default: the embedded random speech model)")
    ap.add_argument("--concurrency", default="1,2,4,8", help="levels, e.g. 1,2,4,8")
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--voice", default="")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for `omnivox serve` (repeat)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each level (medians reported)")
    ap.add_argument("--compare-first-hop", type=int, metavar="N",
                    help="also run a server with --speech-first-hop N, alternating with the default one")  # fmt: skip
    ap.add_argument("--compare-checkout", type=Path, metavar="DIR",
                    help="also run a server on the code in DIR (an older worktree), alternating")  # fmt: skip
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    levels = [int(v) for v in args.concurrency.split(",") if v.strip()]
    from omnivox.benchmarks.main import git_commit

    # What a results file needs to be quoted from: when, at which commit, on how busy a machine, by which command.
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "load_average_at_start": list(os.getloadavg()),
        "command": " ".join(["python -m omnivox.benchmarks.speech", *(argv if argv is not None else sys.argv[1:])]),
        "text_chars": len(args.text),
    }
    servers = []
    address = args.address
    from omnivox.benchmarks.systems.omnivox_grpc import ServerProcess

    model = args.model
    compare = args.compare_first_hop is not None or args.compare_checkout is not None
    if model is None and (address is None or compare):
        from omnivox.services.parts.defaults import ensure_default_speech_model

        model = str(ensure_default_speech_model())
    try:
        if address is None:
            servers.append(ServerProcess(model, args.server_arg, Path("bench-results") / "speech-server.log"))
            address = servers[-1].address
        if not compare:
            result = run_levels(address, levels, args.text, args.voice, repeats=args.repeats)
        elif args.compare_checkout is not None:
            servers.append(_checkout_server(args.compare_checkout, model, args.server_arg))
            head = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=args.compare_checkout, capture_output=True
            )
            meta["before"] = f"omnivox serve from {args.compare_checkout} (commit {head.stdout.decode().strip()})"
            result = run_compare(address, servers[-1].address, levels, args.text, args.voice, args.repeats)
        else:
            before_args = [*args.server_arg, "--speech-first-hop", str(args.compare_first_hop)]
            servers.append(ServerProcess(model, before_args, Path("bench-results") / "speech-server-before.log"))
            meta["before"] = f"omnivox serve --speech-first-hop {args.compare_first_hop}"
            result = run_compare(address, servers[-1].address, levels, args.text, args.voice, args.repeats)
    finally:
        for server in servers:
            server.close()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_results(args.out, {**meta, **result})
    print(format_table(result))
    return 0


def _checkout_server(checkout: Path, model: str, server_args: list[str]):
    """`omnivox serve` importing omnivox from `checkout`: its pyproject's package-dir laid out as symbolic links in
    a temporary folder put first on PYTHONPATH (ahead of this environment's editable install)."""
    import tempfile
    import tomllib

    from omnivox.benchmarks.systems.omnivox_grpc import ServerProcess

    checkout = checkout.resolve()
    dirs = tomllib.loads((checkout / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    farm = Path(tempfile.mkdtemp(prefix="omnivox-checkout-"))
    for package, folder in sorted(dirs.items()):  # "omnivox" first: its folder holds the others' links
        target = farm.joinpath(*package.split("."))
        if package == "omnivox":
            target.mkdir(parents=True)
            (target / "__init__.py").symlink_to(checkout / folder / "__init__.py")
        elif not target.exists():
            target.symlink_to(checkout / folder, target_is_directory=True)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(farm), *([saved] if saved else [])])
    try:
        return ServerProcess(model, server_args, Path("bench-results") / "speech-server-before.log")
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


if __name__ == "__main__":
    sys.exit(main())
