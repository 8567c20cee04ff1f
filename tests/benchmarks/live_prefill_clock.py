"""Does a live scene 1 look hung during a long prefill on a busy machine? The real window, in lecture mode, on the
X server it is given (its size is the recording's), runs a long prompt on the embedded model while two busy loops
take the cores and FFmpeg's x11grab (through PyAV) records the screen; then the recording is read back frame by
frame and the longest stretch of identical frames inside the prefill is reported.

Run it under an X server, e.g. ``Xvfb :96 -screen 0 1280x720x24 & DISPLAY=:96 QT_QPA_PLATFORM=xcb
python -m tests.benchmarks.live_prefill_clock --out build/bench/live``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.benchmarks.record_lecture import pump, wait_until

FPS = 10
RECORDER = """
import os, sys, time, av
display, size, fps, out, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
source = av.open(display, format="x11grab", options={"video_size": size, "framerate": str(fps)})
sink = av.open(out, "w")
stream = sink.add_stream("libx264", rate=fps, options={"qp": "0", "preset": "ultrafast"})   # lossless
stream.width, stream.height = (int(v) for v in size.split("x"))
stream.pix_fmt = "yuv444p"
stamps = []
for frame in source.decode(video=0):
    stamps.append(time.perf_counter())
    for packet in stream.encode(frame.reformat(format="yuv444p")):
        sink.mux(packet)
    if os.path.exists(stop):                   # asked to stop: close the file properly
        break
for packet in stream.encode():
    sink.mux(packet)
sink.close()
print(" ".join(f"{t:.4f}" for t in stamps))
"""


def frozen_stretches(path: Path, stamps: list[float], start: float, end: float) -> tuple[float, int]:
    """The longest run of identical consecutive frames between ``start`` and ``end`` (perf_counter seconds), in
    seconds, and how many frames fell inside."""
    import av
    import numpy as np

    longest, run_began, previous, last, inside = 0.0, None, None, 0.0, 0
    with av.open(str(path)) as video:
        for stamp, frame in zip(stamps, video.decode(video=0)):
            if not start <= stamp <= end:
                previous = None
                continue
            inside += 1
            pixels = frame.to_ndarray()
            if previous is not None and np.array_equal(pixels, previous):
                run_began = run_began if run_began is not None else last
                longest = max(longest, stamp - run_began)
            else:
                run_began = None
            previous, last = pixels, stamp
    return longest, inside


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("live-prefill"))
    p.add_argument("--repeat", type=int, default=8, help="the sample long document, this many times")
    p.add_argument("--hogs", type=int, default=2, help="busy loops beside it")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("KVSCOPE_SETTINGS", str(args.out / "settings.ini"))
    from app.main import build, parse_args, start
    from engine.store.resources import sample_prompts

    options = parse_args(["--scene", "prefill"])
    app, window = build(options)
    window.show()
    start(window, options)
    if not wait_until(lambda: window.client.model is not None and window.client.busy is None, 900):
        raise SystemExit("the model did not load")
    document = next(text for title, text in sample_prompts() if "long" in title.lower())
    window.controls.prompt.setPlainText("\n\n".join([document] * args.repeat))
    window.controls.max_tokens.setValue(8)
    pump(2.0)
    screen = window.screen().geometry()
    size = f"{screen.width()}x{screen.height()}"
    video = args.out / "scene1.mp4"
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(args.hogs)]
    stop = args.out / "stop"
    stop.unlink(missing_ok=True)
    recorder = subprocess.Popen([sys.executable, "-c", RECORDER, os.environ["DISPLAY"], size, str(FPS), str(video),
                                 str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        pump(2.0)
        pressed = time.perf_counter()
        window.controller.run()
        first_token: list[float] = []

        def first_token_seen() -> bool:                # from R to the first token on screen: the prefill seen
            run = window.store.current
            if not first_token and run is not None and run.n_steps > 0:
                first_token.append(time.perf_counter())
            return bool(first_token)

        if not wait_until(first_token_seen, 900) or not wait_until(
                lambda: window.store.current.finished and window.client.busy is None, 900):
            raise SystemExit("the run did not finish")
        pump(2.0)
    finally:
        for hog in hogs:
            hog.kill()
        stop.touch()
        out, _ = recorder.communicate(timeout=120)
    summary = window.store.current.summary()
    stamps = [float(v) for v in out.split()]
    longest, inside = frozen_stretches(video, stamps, pressed, first_token[0])
    result = {"size": size, "hogs": args.hogs, "prompt_tokens": summary.prompt_tokens,
              "prefill_ms": round(summary.prefill_ms, 1), "r_to_first_token_s": round(first_token[0] - pressed, 2),
              "frames": len(stamps), "frames_in_prefill": inside, "longest_frozen_s": round(longest, 3)}
    (args.out / "live-prefill.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    window.close()
    pump(1.0)
    app.quit()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
