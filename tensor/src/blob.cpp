// A tensor over memory that libtorch does not own, with a release callback:
// tch's `Tensor::from_blob` has no deleter, so a tensor made with it (or any
// view or shallow clone of it) could outlive the memory. Here the storage
// calls `release(ctx)` when its last reference goes, and the Rust side keeps
// the registered buffer alive until then.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>

extern "C" {

typedef void (*regent_release_fn)(void *ctx);

// Returns a heap-allocated `at::Tensor*` (tch's `C_tensor`), or null with a
// message in `err` (NUL-terminated, at most `err_len` bytes). On failure
// `release` may or may not have been called; the caller leaks `ctx` rather
// than risk releasing twice.
void *regent_tensor_from_blob(void *data, const int64_t *dims, size_t ndims,
                              const int64_t *strides, size_t nstrides,
                              int dtype, regent_release_fn release, void *ctx,
                              char *err, size_t err_len) {
  try {
    auto options =
        at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype));
    at::Tensor t = at::from_blob(
        data, at::IntArrayRef(dims, ndims), at::IntArrayRef(strides, nstrides),
        [release, ctx](void *) { release(ctx); }, options);
    return new at::Tensor(std::move(t));
  } catch (const std::exception &e) {
    if (err_len > 0) {
      std::strncpy(err, e.what(), err_len - 1);
      err[err_len - 1] = 0;
    }
    return nullptr;
  } catch (...) {
    if (err_len > 0) {
      std::strncpy(err, "unknown C++ exception", err_len - 1);
      err[err_len - 1] = 0;
    }
    return nullptr;
  }
}
}
