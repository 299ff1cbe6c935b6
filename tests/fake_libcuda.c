/* A stand-in for libcuda's cuLaunchKernel (tests/fake_cuda.py builds it): each launch goes to a
 * callback set from Python (which records its arguments as the C ABI passed them), or is only
 * counted; fake_fail makes the next launches of one kernel return an error code. */
typedef int (*launch_cb)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned smem, void *stream, void **params, void **extra);

static launch_cb callback;
static long long launches;
static void *fail_func;
static int fail_times, fail_code;

void fake_set_callback(launch_cb cb) { callback = cb; }
long long fake_launches(void) { return launches; }

/* The next `times` launches of kernel `f` return `code` (and reach no callback). */
void fake_fail(void *f, int times, int code) { fail_func = f; fail_times = times; fail_code = code; }

int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void *stream, void **params, void **extra) {
    launches++;
    if (fail_times > 0 && f == fail_func) {
        fail_times--;
        return fail_code;
    }
    return callback ? callback(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra) : 0;
}
