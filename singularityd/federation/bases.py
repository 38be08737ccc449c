"""A base of a moving job's process images, so that after its stop only what the base lacks is sent.

This kernel has no memory dirty tracking, so CRIU cannot pre-dump: after the stop a move would send
the job's whole process images. Instead, while the job still runs, the source dumps its processes
in place (`dump_base`: CRIU --leave-running into a folder of its own, outside the image store; the
job is frozen as long as any checkpoint's dump freezes it) and sends the pages images with the
pre-copied device state. After the stop, each large pages image of the final checkpoint is staged
as a recipe against that base plus the blocks the base lacks (`stage_deltas`, see pagedelta; made by
`early_deltas` as soon as CRIU has written the images, beside the hashing of the manifest); the
target rebuilds the images (`rebuild_deltas`) and checks every file of the checkpoint against the
manifest's sha256 before the job runs there (the rebuilt images while CRIU restores the processes
stopped), so a base that went wrong fails the move, never the job. As soon as the base has
arrived, the target copies each of its pages images to a draft (`draft_images`, while the job
still runs): the rebuild writes over the draft, quicker than filling a new file while the job is
stopped (on this VM writes into new files run at a fraction of the speed of writes over pages a
file already has), and leaves alone the runs the base holds at the same offset.

In the directory a move sends (see jobfiles), besides the job's files:

    base/pages-<n>.img                       the base's pages images (sent while the job ran)
    draft/pages-<n>.img                      on the target only: a copy of the base's, to rebuild over
    delta/checkpoint/<seq>/images/pages-<n>.img.recipe    how to rebuild the image from the base
    delta/checkpoint/<seq>/images/pages-<n>.img.literals  the blocks the base lacks

The base's files are part of the final transfer too, so a target that lost them gets them again
(the chunks it still holds are not resent). Blocking file work, but `dump_base`: call it from a thread.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from singularityd.checkpoint.coordinator import JobCheckpoints
from singularityd.checkpoint.manifest import IMAGES_DIR
from singularityd.checkpoint.service import PAGES_IMAGES
from singularityd.federation import jobfiles
from singularityd.federation.pagedelta import BaseIndex, DeltaFigures, apply_recipe, index_base, make_recipe

BASE_DIR = "base"
DRAFT_DIR = "draft"
DRAFT_SUFFIX = ".partial"
DELTA_DIR = "delta"
RECIPE_SUFFIX = ".recipe"
LITERALS_SUFFIX = ".literals"
DELTA_MIN_BYTES = 1 << 20
"""Smaller pages images are sent as they are (a recipe would save next to nothing)."""


@dataclass(frozen=True)
class ProcessBase:
    """An in-place dump of a running job's processes, indexed by block, on the sending node."""

    folder: Path
    """Holds BASE_DIR/ (CRIU's images) and CRIU's log; the base's files are named relative to it."""
    index: BaseIndex
    frozen_s: float
    """How long CRIU froze the job for it."""

    @property
    def bytes(self) -> int:
        """Bytes of the base's pages images."""
        return sum((self.folder / name).stat().st_size for name in self.index.names)


@dataclass(frozen=True)
class DeltaSummary:
    """What `stage_deltas` did: the images replaced, their bytes, and the bytes that replace them."""

    images: int = 0
    image_bytes: int = 0
    literal_bytes: int = 0
    recipe_bytes: int = 0


async def dump_base(checkpoints: JobCheckpoints, job_id: int, pid: int, folder: Path) -> ProcessBase:
    """Dump the job's tree (root at host PID `pid`) in place into `folder` (made afresh) and index
    its pages images; CheckpointError (CRIU) or OSError say why it could not be."""
    await asyncio.to_thread(jobfiles.remove, folder)
    folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder.mkdir(mode=0o700)
    images = folder / BASE_DIR
    images.mkdir(mode=0o700)
    stats = await checkpoints.dump_in_place(job_id, pid, images, folder / "dump.log")
    names = sorted(f"{BASE_DIR}/{p.name}" for p in images.glob(PAGES_IMAGES))
    index = await asyncio.to_thread(index_base, folder, names)
    return ProcessBase(folder, index, stats.pause_s)


def stage_base(staging: Path, base: ProcessBase) -> None:
    """Add the base's pages images to a directory to send (hard links)."""
    for name in base.index.names:
        (staging / name).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        jobfiles.link_or_copy(base.folder / name, staging / name)


@dataclass(frozen=True)
class EarlyDelta:
    """A pages image's recipe and literals against the base, made as soon as CRIU had written the
    image (beside the hashing of the checkpoint's manifest), for stage_deltas to take."""

    image: tuple[int, int, int, int]
    """The image it was made from: device, inode, size, modification time (ns)."""
    recipe: Path
    literals: Path
    figures: DeltaFigures


def _file_identity(info: os.stat_result) -> tuple[int, int, int, int]:
    """Which file, of what size and age (a staged image is a hard link to the checkpoint's)."""
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _large_pages_images(images: Sequence[Path]) -> Iterator[tuple[Path, os.stat_result]]:
    """The regular files among these pages images that are large enough for a recipe, with their lstat."""
    for image in images:
        info = image.lstat()
        if info.st_size >= DELTA_MIN_BYTES and stat.S_ISREG(info.st_mode):
            yield image, info


def early_deltas(images: Path, base: ProcessBase, folder: Path) -> dict[str, EarlyDelta]:
    """Make the recipe and literals of each large pages image in a checkpoint's `images` folder
    (CRIU done with it) against `base`, into `folder` (made afresh); by image name."""
    jobfiles.remove(folder)
    folder.mkdir(parents=True, mode=0o700)
    made = {}
    for image, info in _large_pages_images(sorted(images.glob(PAGES_IMAGES))):
        recipe, literals = folder / (image.name + RECIPE_SUFFIX), folder / (image.name + LITERALS_SUFFIX)
        figures = make_recipe(image, base.index, recipe, literals, base.folder)
        made[image.name] = EarlyDelta(_file_identity(info), recipe, literals, figures)
    return made


def stage_deltas(
    staging: Path, base: ProcessBase, early: Mapping[str, EarlyDelta] | None = None
) -> DeltaSummary:
    """Replace each large pages image of the staged checkpoint by its recipe and literals against
    `base` (taken from `early` where made from the same file), and add the base (see the module's
    docstring); what was replaced."""
    summary = DeltaSummary()
    images = sorted(staging.glob(f"{jobfiles.CHECKPOINT_DIR}/*/{IMAGES_DIR}/{PAGES_IMAGES}"))
    for image, info in _large_pages_images(images):
        delta = staging / DELTA_DIR / image.relative_to(staging)
        delta.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        recipe, literals = (
            delta.with_name(delta.name + RECIPE_SUFFIX),
            delta.with_name(delta.name + LITERALS_SUFFIX),
        )
        made = (early or {}).get(image.name)
        if made is not None and made.image == _file_identity(info):
            os.replace(made.recipe, recipe)
            os.replace(made.literals, literals)
            figures = made.figures
        else:
            figures = make_recipe(image, base.index, recipe, literals, base.folder)
        os.chmod(literals, info.st_mode & 0o777)
        image.unlink()
        summary = DeltaSummary(
            summary.images + 1,
            summary.image_bytes + figures.size,
            summary.literal_bytes + figures.literal_bytes,
            summary.recipe_bytes + figures.recipe_bytes,
        )
    if summary.images:
        stage_base(staging, base)
    return summary


def draft_images(incoming: Path) -> int:
    """Copy each pages image of the base received in `incoming` to a draft of the image of the same
    name that the rebuild will write (see the module's docstring); the bytes copied. A draft is
    renamed into place once whole, so the rebuild never takes a partial one."""
    copied = 0
    for base in sorted((incoming / BASE_DIR).glob(PAGES_IMAGES)):
        drafts = incoming / DRAFT_DIR
        drafts.mkdir(mode=0o700, exist_ok=True)
        partial = drafts / (base.name + DRAFT_SUFFIX)
        shutil.copyfile(base, partial, follow_symlinks=False)
        partial.rename(drafts / base.name)
        copied += (drafts / base.name).stat().st_size
    return copied


def drafts_ready(incoming: Path) -> int:
    """How many whole drafts `incoming` holds (draft_images)."""
    return len(list((incoming / DRAFT_DIR).glob(PAGES_IMAGES)))


def rebuild_deltas(incoming: Path, *, hash_as_written: bool = True) -> dict[str, str | None]:
    """Rebuild every image a received directory holds as a recipe, then drop the recipes and the
    base; by path in `incoming`, each image rebuilt and its sha256 (hashed as it was written; None
    without `hash_as_written`, the caller hashing the images later). DeltaError or OSError when one
    cannot be (nothing is dropped)."""
    recipes = (
        sorted((incoming / DELTA_DIR).rglob(f"*{RECIPE_SUFFIX}")) if (incoming / DELTA_DIR).is_dir() else []
    )
    rebuilt = {}
    for recipe in recipes:
        relative = recipe.relative_to(incoming / DELTA_DIR)
        image = incoming / relative.with_name(relative.name.removesuffix(RECIPE_SUFFIX))
        literals = recipe.with_name(recipe.name.removesuffix(RECIPE_SUFFIX) + LITERALS_SUFFIX)
        image.unlink(missing_ok=True)
        draft = incoming / DRAFT_DIR / image.name
        _, rebuilt[image.relative_to(incoming).as_posix()] = apply_recipe(
            recipe, literals, incoming, image, draft, hash_as_written=hash_as_written
        )
        os.chmod(image, literals.stat().st_mode & 0o777)
    for left in (DELTA_DIR, BASE_DIR, DRAFT_DIR):
        jobfiles.remove(incoming / left)
    return rebuilt
