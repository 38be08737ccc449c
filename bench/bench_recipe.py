"""Finding a process image's blocks in a base: by comparison first against by digest alone, in one run.

Run (root, CRIU): .venv/bin/python bench/bench_recipe.py [--runs 5] [--seconds 5]

A real daemon runs a proxied training job (tests/programs/long_train.py) and checkpoints it in
place twice, `--seconds` apart, as a move's base and its final dump would be. Then the second
checkpoint's pages images are turned into recipes against the first's (pagedelta.make_recipe),
alternating the two ways on the same files: "compared" (blocks compared with the base block after
the last one found, only the others hashed: what a move does) and "digests" (every block hashed
and looked up). Reported: the median and best seconds of the runs, blocks hashed (counted in one
more, untimed run), literal bytes and recipe bytes, and the ratio of the medians. Both ways must
give recipes that rebuild the image.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from singularityd.federation import pagedelta  # noqa: E402
from singularityd.federation.pagedelta import (  # noqa: E402
    BaseIndex,
    DeltaFigures,
    apply_recipe,
    index_base,
    make_recipe,
)
from tests.helpers import running_daemon  # noqa: E402

PYTHON = sys.executable
PROGRAM = REPO / "tests" / "programs" / "long_train.py"


def two_dumps(folder: Path, seconds: float) -> tuple[Path, Path]:
    """The images folders of two in-place checkpoints of one running job, `seconds` apart."""
    with running_daemon(folder / "daemon") as daemon:
        job = daemon.submit(
            PYTHON, str(PROGRAM), "--steps", "1000000", options=["--gpus", "1", "--cwd", str(folder)]
        )
        daemon.wait_state(job, "RUNNING")
        time.sleep(seconds)
        for _ in range(2):
            result = daemon.sing("checkpoint", str(job), timeout=300)
            if result.code != 0:
                raise SystemExit(f"checkpoint failed: {result.err.strip()}")
            time.sleep(seconds)
        daemon.sing("cancel", str(job))
        found = sorted(daemon.state_dir.glob(f"checkpoints/{job}/*/images"))
        copies = []
        for n, images in enumerate(found[:2]):
            copy = folder / f"dump-{n}"
            shutil.copytree(images, copy)
            copies.append(copy)
    return copies[0], copies[1]


def recipe_of(folder: Path, image: Path, index: BaseIndex, base_root: Path | None) -> DeltaFigures:
    """The recipe and literals of one image, in `folder`."""
    recipe, literals = folder / f"{image.name}.recipe", folder / f"{image.name}.literals"
    return make_recipe(image, index, recipe, literals, base_root)


@contextlib.contextmanager
def counted_digests() -> Iterator[list[int]]:
    """Count the blocks pagedelta hashes while inside (a list of one count)."""
    hashed = [0]
    real = pagedelta._digest

    def counted(block: bytes | memoryview) -> bytes:
        hashed[0] += 1
        return real(block)

    pagedelta._digest = counted
    try:
        yield hashed
    finally:
        pagedelta._digest = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0, help="between the job's start and each dump")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-recipe-"))
    try:
        first, second = two_dumps(folder, args.seconds)
        root = folder / "root"
        (root / "base").mkdir(parents=True)
        names = []
        for image in sorted(first.glob("pages-*.img")):
            shutil.copy(image, root / "base" / image.name)
            names.append(f"base/{image.name}")
        index = index_base(root, names)
        images = [p for p in sorted(second.glob("pages-*.img")) if p.stat().st_size >= 1 << 20]
        times: dict[str, list[float]] = {"compared": [], "digests": []}
        figures: dict[str, tuple[int, int, int]] = {}
        for run in range(args.runs + 1):  # the last run counts the blocks hashed, untimed
            counting = run == args.runs
            ways = ("compared", "digests") if run % 2 == 0 else ("digests", "compared")
            for way in ways:
                began = time.perf_counter()
                with counted_digests() if counting else contextlib.nullcontext([0]) as hashed:
                    made = [
                        recipe_of(folder, image, index, root if way == "compared" else None)
                        for image in images
                    ]
                if counting:
                    literal, recipe_bytes = (
                        sum(m.literal_bytes for m in made),
                        sum(m.recipe_bytes for m in made),
                    )
                    figures[way] = (hashed[0], literal, recipe_bytes)
                    continue
                times[way].append(time.perf_counter() - began)
                rebuilt = folder / "rebuilt.img"
                for image in images:
                    recipe, literals = folder / f"{image.name}.recipe", folder / f"{image.name}.literals"
                    apply_recipe(recipe, literals, root, rebuilt)
                    if rebuilt.read_bytes() != image.read_bytes():
                        raise SystemExit(f"{way}: the recipe of {image.name} does not rebuild it")
        size = sum(p.stat().st_size for p in images)
        print(f"{len(images)} pages image(s), {size / (1 << 20):.1f} MiB, {args.runs} runs each, alternating")
        print("| way | median | best | blocks hashed | literal bytes | recipe bytes |")
        print("|---|---:|---:|---:|---:|---:|")
        for way, seconds in times.items():
            blocks, literal, recipe_bytes = figures[way]
            print(
                f"| {way} | {statistics.median(seconds):.3f} s | {min(seconds):.3f} s | {blocks} "
                f"| {literal} | {recipe_bytes} |"
            )
        ratio = statistics.median(times["compared"]) / statistics.median(times["digests"])
        print(f"compared / digests (medians): {ratio:.2f}x")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
