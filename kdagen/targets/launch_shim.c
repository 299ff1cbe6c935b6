/* kdagen launch shim: both kernels of an sm80 call (kda_prep, kda_recur) in one foreign call.
 *
 * The bound launch (kdagen/targets/sm80.py) prepares a struct kdagen_pair per call signature
 * and stream (function handles, grids, blocks, shared memory, stream, the address of the
 * kernels' argument array) once; a call writes its pointers into the parameter struct that
 * array points at and calls kdagen_launch_pair: one Python -> C transition instead of two
 * cuda-bindings calls. libcuda's cuLaunchKernel is looked up with dlopen/dlsym, so building
 * this file needs only a host C compiler (no CUDA toolkit). Built by kdagen/targets/launch_shim.py.
 */
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>

/* Bumped whenever a struct or a function below changes (launch_shim.py checks it on load). */
#define KDAGEN_SHIM_ABI 1

typedef int (*cu_launch_kernel_t)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                  unsigned bz, unsigned smem, void *stream, void **params, void **extra);

struct kdagen_launch {
    void *func;         /* CUfunction */
    void *stream;       /* CUstream */
    void **args;        /* kernelParams: here one pointer, to the by-value KdaParams struct */
    unsigned grid[3];   /* kda_prep's grid[0] is unused: kdagen_launch_pair's prep_grid_x */
    unsigned block[3];
    unsigned smem;      /* dynamic shared memory, bytes */
    unsigned pad_;
};

struct kdagen_pair {
    struct kdagen_launch k[2]; /* k[0] kda_prep, k[1] kda_recur */
    int failed;                /* which launch returned an error (0, 1), -1 when none did */
    int pad_;
};

static cu_launch_kernel_t launch_kernel;
static char last_error[512];

int kdagen_shim_abi(void) { return KDAGEN_SHIM_ABI; }

/* sizeof and the offsets the Python mirror must agree with, in bytes. */
int kdagen_shim_layout(long long *out, int n) {
    const long long v[] = {
        (long long)sizeof(struct kdagen_pair), (long long)sizeof(struct kdagen_launch),
        (long long)offsetof(struct kdagen_launch, func), (long long)offsetof(struct kdagen_launch, stream),
        (long long)offsetof(struct kdagen_launch, args), (long long)offsetof(struct kdagen_launch, grid),
        (long long)offsetof(struct kdagen_launch, block), (long long)offsetof(struct kdagen_launch, smem),
        (long long)offsetof(struct kdagen_pair, failed),
    };
    int count = (int)(sizeof v / sizeof v[0]);
    for (int i = 0; i < n && i < count; i++) out[i] = v[i];
    return count;
}

/* Find cuLaunchKernel in `lib` (libcuda.so.1, or a stand-in for tests): 0, else -1 and
 * kdagen_shim_error() says why. */
int kdagen_shim_init(const char *lib) {
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(last_error, sizeof last_error, "dlopen(%s): %s", lib, dlerror());
        return -1;
    }
    void *sym = dlsym(h, "cuLaunchKernel");
    if (!sym) {
        snprintf(last_error, sizeof last_error, "dlsym(cuLaunchKernel) in %s: %s", lib, dlerror());
        return -1;
    }
    launch_kernel = (cu_launch_kernel_t)sym;
    return 0;
}

const char *kdagen_shim_error(void) { return last_error; }

static int launch(struct kdagen_launch *l, unsigned gx) {
    return launch_kernel(l->func, gx, l->grid[1], l->grid[2], l->block[0], l->block[1], l->block[2], l->smem,
                         l->stream, l->args, NULL);
}

/* kda_prep with grid x prep_grid_x (0: no chunks, not launched), then kda_recur. Returns the
 * first failing launch's CUresult (p->failed says which) or 0. */
int kdagen_launch_pair(struct kdagen_pair *p, unsigned prep_grid_x) {
    int err;
    if (!launch_kernel) {
        p->failed = 0;
        return 3; /* CUDA_ERROR_NOT_INITIALIZED: kdagen_shim_init was not called */
    }
    if (prep_grid_x && (err = launch(&p->k[0], prep_grid_x)) != 0) {
        p->failed = 0;
        return err;
    }
    if ((err = launch(&p->k[1], p->k[1].grid[0])) != 0) {
        p->failed = 1;
        return err;
    }
    return 0;
}
