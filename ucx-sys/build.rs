//! Links the system UCX found with pkg-config. The bindings are committed (see
//! hack/gen-ucx-bindings.sh), so only the libraries are needed here.

fn main() {
    if let Err(e) = pkg_config::Config::new().atleast_version("1.12").probe("ucx") {
        panic!("UCX >= 1.12 not found with pkg-config ({e}); install it with `apt-get install libucx-dev`");
    }
}
