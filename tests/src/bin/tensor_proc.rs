//! The proc binary of the tensor suite (`tests/tensor.rs`): the test
//! actors (linking the library registers them), libtorch on one thread,
//! then `bootstrap()`, which runs the proc runtime when a host agent starts
//! this binary.

// Linking the library registers its actors.
use regent_tests as _;

fn main() {
    // Members fold on their own threads; libtorch's pool would only
    // compete with them.
    regent_tensor::tch::set_num_threads(1);
    regent_mesh::bootstrap();
    eprintln!("tensor_proc is started by a host agent as a proc; it has no controller role");
    std::process::exit(2);
}
