#!/usr/bin/env bash
# FlashAttention-4 (the `fa4` extra) for a GPU machine that cannot reach the network, in
# halves small enough to carry: its cutlass DSL library wheel alone is 92 MB.
#   bash bench/fa4_wheels.sh download [DIR]   (a machine with the network) the wheels for
#       CPython 3.12 on x86-64 Linux into DIR (default .whl), the 92 MB one cut in two:
#       DIR/a holds its first 48 MB and cuda-bindings' wheel, DIR/b the rest and every other wheel
#       (56 and 51 MB: each half leaves room in one call's 64 MiB for the checkout and some data)
#   bash bench/fa4_wheels.sh receive DIR STAGE    (the GPU machine) copy DIR's files into
#       STAGE; once both halves are there, join them and install every wheel into
#       STAGE/site-packages (named as pip's own: quack's compile cache takes the code under a
#       folder of that name for installed library code); prints the PYTHONPATH entries that
#       import it (the DSL's .pth needs site.addsitedir). Run it once per half, the machine
#       kept between the two.
# Then: PYTHONPATH=$(bash bench/fa4_wheels.sh path STAGE):$PWD python3 ...
set -euo pipefail
BIG=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
PIP_FLAGS=(--no-deps --only-binary=:all: --python-version 3.12)

site_path() {  # STAGE -> the sys.path entries a site directory STAGE/site-packages adds, joined by ':'
  python3 -c "import site, sys; site.addsitedir(sys.argv[1]); \
print(':'.join(p for p in sys.path if p.startswith(sys.argv[1])))" "$1/site-packages"
}

case ${1:-} in
  download)
    dir=${2:-.whl}; mkdir -p "$dir/a" "$dir/b"
    pip download -q "${PIP_FLAGS[@]}" --pre --platform manylinux_2_28_x86_64 -d "$dir" flash-attn-4==4.0.0b36 \
      nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
      nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels apache-tvm-ffi torch-c-dlpack-ext cuda-pathfinder \
      'cuda-bindings>=13,<14'
    pip download -q "${PIP_FLAGS[@]}" --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
      einops protobuf
    split -b 50000000 "$dir/$BIG" "$dir/a/cu13.part."
    mv "$dir/a/cu13.part.ab" "$dir/b/"
    cp "$dir"/*.whl "$dir/b/" && rm "$dir/b/$BIG" && mv "$dir"/b/cuda_bindings-*.whl "$dir/a/"
    du -sh "$dir/a" "$dir/b" ;;
  receive)
    src=$2 stage=$3; mkdir -p "$stage"
    cp "$src"/* "$stage/"
    if [ -f "$stage/cu13.part.aa" ] && [ -f "$stage/cu13.part.ab" ]; then
      cat "$stage/cu13.part.aa" "$stage/cu13.part.ab" > "$stage/$BIG" && rm "$stage"/cu13.part.*
      pip install -q --no-deps --target "$stage/site-packages" "$stage"/*.whl
      site_path "$stage"
    else
      echo "one half in $stage; run again with the other"
    fi ;;
  path) site_path "$2" ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
