#!/usr/bin/env bash
# Copies this machine's `perf` and the libraries it links beyond glibc and libstdc++ into
# .exp/perf (ignored by git), for a device call that carries .exp: the GPU image has no perf,
# and host_cpu.sh's decode_perf part profiles the CPU decode kernel with it when it is there.
#
#   bash benchmarks/gpu/perf_bundle.sh      # needs perf here (Debian: linux-perf)
set -eu
cd "$(dirname "$0")/../.."
perf=$(command -v perf) || { echo "no perf on this machine" >&2; exit 1; }
grep -qx '/.exp/' .git/info/exclude 2>/dev/null || echo /.exp/ >> .git/info/exclude
rm -rf .exp/perf && mkdir -p .exp/perf
cp "$perf" .exp/perf/
for lib in $(ldd "$perf" | awk '/=>/ {print $3}'); do
  case $(basename "$lib") in
    libc.so*|libm.so*|libstdc++*|libgcc_s*|ld-linux*) ;;  # the image's own, newer
    *) cp -L "$lib" .exp/perf/ ;;
  esac
done
du -sh .exp/perf
