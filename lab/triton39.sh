#!/usr/bin/env bash
# Triton 3.9 on the H200 (whose image has 3.6), for Gluon's TMA multicast over a cluster of two (`multicast=` on
# tma.async_load, cluster-scope mbarriers): the 286 MB wheel cannot travel in one device call (64 MiB with the tree,
# ~6 MB), so it travels stripped and compressed in parts, one a call, while the machine stays warm (30 s idle).
#
#   here:    bash lab/triton39.sh pack          # ~10 min on 2 cores: .triton39/part0 .. partN (<= 50 MB each)
#   device:  call i carries [".triton39/partI"] alone (a part and the ~6 MB tree: ~58 MB; with .whl's 14 MB it would
#            pass 64 MiB) and runs `bash lab/triton39.sh unpack` first (it moves the part to
#            /tmp/t39parts, outside the refreshed tree); the call that completes the set checks the sha256 against
#            lab/triton39.sha256 and unpacks into /tmp/t39site; later calls:
#            TRITON_BACKENDS_IN_TREE=1 PYTHONPATH=/tmp/t39site:$PYTHONPATH python3 ...   (torch stays the image's
#            2.11; in-tree backends: the parts carry no dist-info)
# Kept: the Python package, libtriton.so, ptxas-blackwell (3.9 builds sm_90 with it) and the nvidia backend's
# headers; left out: the AMD backend, CUPTI / proton (the profiler), the legacy ptxas (arch < 90), cuobjdump /
# nvdisasm (disassembly only).
set -eu
VERSION=3.9.0
case "${1:-}" in
  pack)
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
      --platform manylinux_2_28_x86_64 "triton==$VERSION" -d "$tmp/wheel"
    python3 - "$tmp" <<'PY'
import sys, zipfile, glob
tmp = sys.argv[1]
skip = ("triton/backends/amd/", "cupti", "libproton", "/bin/cuobjdump", "/bin/nvdisasm")
# Triton 3.9 compiles sm_90 with its ptxas-blackwell (the legacy ptxas serves arch < 90 only)
z = zipfile.ZipFile(glob.glob(f"{tmp}/wheel/*.whl")[0])
z.extractall(f"{tmp}/site", members=[i for i in z.infolist() if i.filename.startswith("triton/")
                                     and not any(s in i.filename for s in skip)
                                     and not i.filename.endswith("/bin/ptxas")])
PY
    chmod +x "$tmp"/site/triton/backends/nvidia/bin/*
    tar cf - -C "$tmp/site" --sort=name --mtime=@0 --owner=0 --group=0 triton | xz -T2 -9 > "$tmp/t39.tar.xz"
    rm -rf .triton39 && mkdir .triton39
    split -b 50m -d -a 1 "$tmp/t39.tar.xz" .triton39/part
    (cd "$tmp" && sha256sum t39.tar.xz) | cut -d' ' -f1 > lab/triton39.sha256
    echo "parts: $(ls .triton39 | tr '\n' ' ')sha256 $(cat lab/triton39.sha256) (commit lab/triton39.sha256)"
    ;;
  unpack)
    mkdir -p /tmp/t39parts
    for p in .triton39/part*; do [ -e "$p" ] && mv -f "$p" /tmp/t39parts/; done
    [ -d /tmp/t39site/triton ] && { echo "triton39: unpacked already"; exit 0; }
    have=$(cat /tmp/t39parts/part* 2>/dev/null | sha256sum | cut -d' ' -f1)
    if [ "$have" != "$(cat lab/triton39.sha256)" ]; then
      echo "triton39: parts so far $(ls /tmp/t39parts | tr '\n' ' ')(the sum does not match yet: carry the next)"; exit 0
    fi
    rm -rf /tmp/t39site.new && mkdir -p /tmp/t39site.new
    cat /tmp/t39parts/part* | xz -d | tar xf - -C /tmp/t39site.new && mv /tmp/t39site.new /tmp/t39site
    TRITON_BACKENDS_IN_TREE=1 PYTHONPATH=/tmp/t39site python3 -c "import triton; print('triton39: unpacked', triton.__version__)"
    ;;
  *) echo "usage: bash lab/triton39.sh pack|unpack" >&2; exit 2;;
esac
