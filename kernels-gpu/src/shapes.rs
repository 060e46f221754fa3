//! The shapes of the GQA-grouped kernels: every element type (bf16, f16), head dimension 64
//! and 128, and group size 1 to [`MAX_GROUP`] (query heads per KV head). The host's geometry
//! accepts exactly these (`lserve::geometry::ModelGeometry`).
//!
//! The decode attention takes the group as a launch parameter (it only sizes the rows of the
//! query fragments and the final merge), so it is built per (element type, head dim). The page
//! scorer keeps per-head state in registers and is built per group size:
//! [`grouped_kernels!`](crate::grouped_kernels) instantiates such a family once per shape, each
//! instance in its own module (`<dtype>::d<D>::g<G>`) exporting its entry points under the names
//! the host looks up, `{family}_{dtype}_d{D}_g{G}`.

use lserve_abi::decode::MAX_GROUP;

// `grouped_kernels!` lists groups 1 to 8.
const _: () = assert!(MAX_GROUP == 8);

/// Instantiates a kernel family for every grouped shape (see the module docs).
///
/// `$family!(elem, "dtype", D, G)` is invoked inside module `<dtype>::d<D>::g<G>`, with `elem`
/// the element marker's path (`$crate::convert::Bf16` or `F16`), `"dtype"` its name as a string
/// literal, and `D`, `G` integer literals; it declares the entry points of that shape (with
/// absolute paths, and `export_name`s built from the arguments with `concat!`).
#[macro_export]
macro_rules! grouped_kernels {
    ($family:ident) => {
        /// The bf16 instances.
        pub mod bf16 {
            $crate::grouped_kernels!(@dims $family, $crate::convert::Bf16, "bf16");
        }
        /// The f16 instances.
        pub mod f16 {
            $crate::grouped_kernels!(@dims $family, $crate::convert::F16, "f16");
        }
    };
    (@dims $family:ident, $elem:path, $dtype:literal) => {
        /// The instances of head dimension 64.
        pub mod d64 {
            $crate::grouped_kernels!(@groups $family, $elem, $dtype, 64);
        }
        /// The instances of head dimension 128.
        pub mod d128 {
            $crate::grouped_kernels!(@groups $family, $elem, $dtype, 128);
        }
    };
    (@groups $family:ident, $elem:path, $dtype:literal, $d:literal) => {
        $crate::grouped_kernels!(@group $family, $elem, $dtype, $d, g1 1);
        $crate::grouped_kernels!(@group $family, $elem, $dtype, $d, g2 2);
        $crate::grouped_kernels!(@group $family, $elem, $dtype, $d, g3 3);
        $crate::grouped_kernels!(@group $family, $elem, $dtype, $d, g4 4);
        $crate::grouped_kernels!(@group $family, $elem, $dtype, $d, g5 5);
        $crate::grouped_kernels!(@group $family, $elem, $dtype, $d, g6 6);
        $crate::grouped_kernels!(@group $family, $elem, $dtype, $d, g7 7);
        $crate::grouped_kernels!(@group $family, $elem, $dtype, $d, g8 8);
    };
    (@group $family:ident, $elem:path, $dtype:literal, $d:literal, $module:ident $g:literal) => {
        #[doc = concat!("The instance of group size ", $g, ".")]
        pub mod $module {
            $family!($elem, $dtype, $d, $g);
        }
    };
}
