//! What the test suites of every oxidiff crate share (a dev-dependency only): one definition of
//! "close" for float outputs, a deadline for work that may hang, a way to give a test its own
//! process when it needs environment variables the library reads, and f64 references.
//!
//! The comparisons fail on any NaN or infinity on either side: `f32::max` folds skip NaN, so a
//! comparison written with it passes an all-NaN output. Failures name the element.

pub mod close;
pub mod process;
pub mod reference;

pub use close::{
    assert_close, assert_close_with_floor, max_magnitude, relative_error,
    relative_error_with_floor, worst_difference, Value, Worst,
};
pub use process::{isolated, Deadline};
