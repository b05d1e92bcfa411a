//! Helpers shared by the unit tests.

/// One libtorch thread (the machines have 2 cores, shared); libtorch
/// allows setting the interop threads once per process.
pub(crate) fn init_torch() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tch::set_num_threads(1);
        tch::set_num_interop_threads(1);
    });
}
