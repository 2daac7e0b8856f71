# What the set-up installs, in one place: sourced by tools/bootstrap.sh (which installs it)
# and tools/wheelhouse.sh (which downloads it for an offline install).

# FFCV compiles against libturbojpeg and OpenCV (found through pkg-config);
# Pillow-SIMD compiles against libjpeg and zlib.
DEB_BUILD_PACKAGES=(libturbojpeg0-dev libopencv-dev pkg-config libjpeg-dev zlib1g-dev)
# The tests serve datasets over HTTP(S) with nginx (range requests, an access log to count them),
# with a certificate of a test CA that openssl makes; nginx's echo module delays its answers for
# the loader benchmark's --latency-in server.
DEB_TEST_PACKAGES=(nginx-light openssl libnginx-mod-http-echo)
TORCH_SPEC="torch==2.13.0"            # the CPU build here; an unpinned torch pulls CUDA wheels
FFCV_SPEC="ffcv==1.0.2"
FFCV_DEPS=(assertpy fastargs "opencv-python" psutil pytorch_pfn_extras terminaltables)   # its Requires-Dist
DALI_SPEC="nvidia-dali-cuda120>=2.0,<3"
REST_SPECS=("numpy>=1.24,<2.6" "numba>=0.60,<0.70" "webdataset>=1.0,<2" "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "tqdm>=4.60" "pyyaml>=6"
            "simplejpeg>=1.7,<2"    # simplejpeg: the decode-only bound in benchmarks/loaders.py
            "obstore>=0.6,<1"       # data in object storage and behind HTTP(S): pipeline/storage/object_store.py
            "pyarrow>=14" "scipy>=1.10"   # sources read in place: Hugging Face parquet, ImageNet's devkit (meta.mat)
            "ray>=2.40,<3"          # conversion across machines: pipeline/convert/ray_executor.py
            "moto[server]>=5,<6")   # the tests' S3 server
PILLOW_SIMD_SPEC="pillow-simd>=9"
# matplotlib (benchmarks/report.py, tools/plot_run.py) and TensorBoard (the trainer's optional
# event files) declare `pillow`, so a plain install would put stock Pillow over Pillow-SIMD. They
# go in with --no-deps, after their other dependencies installed normally (none of those needs
# pillow); their PIL needs are met by Pillow-SIMD's `PIL`. The list is their Requires-Dist less
# pillow and numpy (numpy comes with its own pin above); tensorboard is held to the minor
# release whose protobuf and grpcio ranges it copies.
NO_DEPS_SPECS=("matplotlib>=3.8,<4" "tensorboard>=2.21,<2.22")
NO_DEPS_DEPS=("contourpy>=1.0.1" "cycler>=0.10" "fonttools>=4.28.2" "kiwisolver>=1.3.1" "packaging>=20.0"
              "pyparsing>=3" "python-dateutil>=2.7"
              "absl-py>=0.4" "grpcio>=1.74.0,<2" "markdown>=2.6.8" "protobuf>=6.31.1,<8" "setuptools>=41"
              "tensorboard-data-server>=0.7,<0.8" "werkzeug>=1.0.1")
