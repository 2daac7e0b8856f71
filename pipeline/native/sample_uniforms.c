/* pipeline.transforms.crops.sample_uniforms in C, bit for bit (numpy_random.h), for compiled code that
 * cannot call numpy's Generator: FFCV's numba decoder (pipeline/backends/ffcv.py) calls it
 * through ctypes, so FFCV draws every sample's crop and flip as the other backends do, where
 * numba's own np.random (MT19937) gave other crops, and took ~1.3 us a sample to seed (this: ~0.1). */
#include "numpy_random.h"

void sample_uniforms(long long seed, long long epoch, long long sample_id, double *out, int count) {
    numpy_uniforms(sample_seed(seed, epoch, sample_id), out, count);
}
