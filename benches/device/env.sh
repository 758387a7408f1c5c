# Source at the start of every command on the GPU machine (see ../shared/docs/DEVICE.md).
# The machine has torch but no Rust toolchain: the extension module travels as the carried,
# git-ignored python/zbuf/_core.abi3.so, and a minimal dist-info registers the "zbuf"
# torch.compile backend entry point the way `pip install` would.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
_site=/tmp/site
_dist=$_site/zbuf-0.1.0.dist-info
mkdir -p "$_dist"
printf 'Metadata-Version: 2.1\nName: zbuf\nVersion: 0.1.0\n' > "$_dist/METADATA"
printf '[torch_dynamo_backends]\nzbuf = zbuf.compile.backend:zbuf_backend\n' > "$_dist/entry_points.txt"
export PYTHONPATH=$_site:$PWD/python:$PWD/tests
zbuf() { python3 -m zbuf.cli "$@"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, zbuf; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
