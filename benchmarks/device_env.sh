# Sourced by every device command (benchmarks/gpu_*.sh), from the repo root on the lent GPU machine:
#   - our package importable as `moe_export` from a folder of symlinks to the source folders (.device-src), with
#     its distribution's metadata (name, version) beside it;
#   - the wheels named in benchmarks/device_wheels.txt installed with --no-deps into .device-deps from
#     $DEVICE_WHEELS (default .whl/, carried to the machine: `carry: [".whl"]`); a named wheel that is not there is
#     reported, and whatever imports it fails in its own stage;
#   - PYTHONPATH set to both, OUT defaulted to /tmp, Python unbuffered, the GPU printed.
# `bash benchmarks/device_wheels.sh` fetches the wheels here (pip download, cp312 manylinux).
OUT="${OUT:-/tmp}"
mkdir -p "$OUT" .device-src/moe_export .device-deps
for d in common export graphs quantize plugins runtime recipes; do
  if [ -d "$d" ]; then ln -sfn "$PWD/$d" ".device-src/moe_export/$d"; fi
done
# the distribution's metadata too (manifests and `/version` ask importlib.metadata for moe-export's version)
version=$(python3 -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
rm -rf .device-src/moe_export-*.dist-info && mkdir -p ".device-src/moe_export-$version.dist-info"
printf 'Metadata-Version: 2.1\nName: moe-export\nVersion: %s\n' "$version" > ".device-src/moe_export-$version.dist-info/METADATA"
device_wheels=()
while read -r spec; do
  spec="${spec%%#*}"; spec="${spec// /}"
  [ -n "$spec" ] || continue
  stem="$(echo "${spec%%==*}" | tr '-' '_')-${spec##*==}"
  found=$(ls "${DEVICE_WHEELS:-.whl}"/"$stem"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$found" ]; then device_wheels+=("$found"); else echo "device_env: wheel $spec missing from ${DEVICE_WHEELS:-.whl}/"; fi
done < benchmarks/device_wheels.txt
if [ "${#device_wheels[@]}" -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .device-deps \
    "${device_wheels[@]}" || echo "device_env: pip install of the carried wheels failed"
fi
export PYTHONPATH="$PWD/.device-src:$PWD/.device-deps:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "device_env: no nvidia-smi"
