# What the set-up installs, in one place: sourced by tools/bootstrap.sh (which installs it)
# and tools/wheelhouse.sh (which downloads it for an offline install).

# FFCV compiles against libturbojpeg and OpenCV (found through pkg-config);
# Pillow-SIMD compiles against libjpeg and zlib.
DEB_BUILD_PACKAGES=(libturbojpeg0-dev libopencv-dev pkg-config libjpeg-dev zlib1g-dev)
TORCH_SPEC="torch==2.13.0"            # the CPU build here; an unpinned torch pulls CUDA wheels
FFCV_SPEC="ffcv==1.0.2"
FFCV_DEPS=(assertpy fastargs "opencv-python" psutil pytorch_pfn_extras terminaltables)   # its Requires-Dist
DALI_SPEC="nvidia-dali-cuda120>=2.0,<3"
REST_SPECS=("numpy>=1.24,<2.6" "numba>=0.60,<0.70" "webdataset>=1.0,<2" "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "tqdm>=4.60" "pyyaml>=6"
            "simplejpeg>=1.7,<2")   # simplejpeg: the decode-only bound in benchmarks/loaders.py
PILLOW_SIMD_SPEC="pillow-simd>=9"
# matplotlib (benchmarks/report.py) declares `pillow`, so a plain install would put stock Pillow
# over Pillow-SIMD. It goes in with --no-deps, after its other dependencies installed normally
# (none of them needs pillow); its PIL needs are met by Pillow-SIMD's `PIL`. This list is
# matplotlib 3.x's Requires-Dist less pillow and numpy (numpy comes with its own pin above).
MATPLOTLIB_SPEC="matplotlib>=3.8,<4"
MATPLOTLIB_DEPS=("contourpy>=1.0.1" "cycler>=0.10" "fonttools>=4.28.2" "kiwisolver>=1.3.1" "packaging>=20.0"
                 "pyparsing>=3" "python-dateutil>=2.7")
