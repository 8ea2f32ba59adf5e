//! Float comparisons that cannot be fooled by NaN: every value on both sides must be finite.

use std::fmt;

/// A float the comparisons read as `f64` (without loss).
pub trait Value: Copy + fmt::Debug {
    fn to_f64(self) -> f64;
}

impl Value for f32 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Value for f64 {
    fn to_f64(self) -> f64 {
        self
    }
}

/// The element where `actual` is farthest from `expected`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Worst {
    pub index: usize,
    pub actual: f64,
    pub expected: f64,
    /// `|actual - expected|`.
    pub difference: f64,
}

impl fmt::Display for Worst {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "worst at index {}: actual {:e}, expected {:e} (difference {:e})",
            self.index, self.actual, self.expected, self.difference
        )
    }
}

/// The largest `|actual - expected|` and where it is. Panics, naming `what`, the index and both
/// values, at the first element that is not finite on either side, and when the lengths differ.
pub fn worst_difference<A: Value, E: Value>(what: &str, actual: &[A], expected: &[E]) -> Worst {
    assert_eq!(
        actual.len(),
        expected.len(),
        "{what}: {} values against {} expected",
        actual.len(),
        expected.len()
    );
    let mut worst = Worst {
        index: 0,
        actual: 0.0,
        expected: 0.0,
        difference: 0.0,
    };
    for (index, (a, e)) in actual.iter().zip(expected).enumerate() {
        let (a, e) = (a.to_f64(), e.to_f64());
        assert!(
            a.is_finite() && e.is_finite(),
            "{what}: non-finite value at index {index}: actual {a}, expected {e}"
        );
        let difference = (a - e).abs();
        if index == 0 || difference > worst.difference {
            worst = Worst {
                index,
                actual: a,
                expected: e,
                difference,
            };
        }
    }
    worst
}

/// The largest `|value|`; panics, naming `what` and the index, at a value that is not finite.
pub fn max_magnitude<V: Value>(what: &str, values: &[V]) -> f64 {
    values.iter().enumerate().fold(0.0, |m, (index, v)| {
        let v = v.to_f64();
        assert!(
            v.is_finite(),
            "{what}: non-finite value {v} at index {index}"
        );
        m.max(v.abs())
    })
}

/// The largest absolute difference over `max(largest |expected|, floor)`, with the worst element.
pub fn relative_error_with_floor<A: Value, E: Value>(
    what: &str,
    actual: &[A],
    expected: &[E],
    floor: f64,
) -> (f64, Worst) {
    let worst = worst_difference(what, actual, expected);
    let scale = max_magnitude(what, expected).max(floor);
    (worst.difference / scale, worst)
}

/// The largest absolute difference over the largest `|expected|` (at least 1e-12), the measure
/// of most parity tests: it tolerates reordered sums in proportion to the output's size.
pub fn relative_error<A: Value, E: Value>(what: &str, actual: &[A], expected: &[E]) -> f64 {
    relative_error_with_floor(what, actual, expected, 1e-12).0
}

/// Asserts [`relative_error_with_floor`] is at most `tol`; the message names the worst element.
/// Returns the error, for the test's log.
pub fn assert_close_with_floor<A: Value, E: Value>(
    what: &str,
    actual: &[A],
    expected: &[E],
    tol: f64,
    floor: f64,
) -> f64 {
    let (error, worst) = relative_error_with_floor(what, actual, expected, floor);
    assert!(
        error <= tol,
        "{what}: relative error {error:e} exceeds {tol:e}; {worst}"
    );
    error
}

/// Asserts [`relative_error`] is at most `tol`; the message names the worst element. Returns the
/// error, for the test's log.
pub fn assert_close<A: Value, E: Value>(what: &str, actual: &[A], expected: &[E], tol: f64) -> f64 {
    assert_close_with_floor(what, actual, expected, tol, 1e-12)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panics(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
        let err = std::panic::catch_unwind(f).expect_err("must panic");
        err.downcast_ref::<String>().cloned().unwrap_or_default()
    }

    #[test]
    fn nan_or_infinity_on_either_side_fails_naming_the_index() {
        let msg = panics(|| {
            relative_error("out", &[1.0f32, f32::NAN], &[1.0f32, 2.0]);
        });
        assert!(msg.contains("out: non-finite value at index 1"), "{msg}");
        let msg = panics(|| {
            relative_error("out", &[f32::NAN; 3], &[f32::NAN; 3]);
        });
        assert!(msg.contains("index 0"), "{msg}");
        let msg = panics(|| {
            relative_error("out", &[1.0f32, 2.0], &[1.0f64, f64::INFINITY]);
        });
        assert!(msg.contains("expected inf"), "{msg}");
        let msg = panics(|| {
            max_magnitude("scale", &[0.0f64, f64::NEG_INFINITY]);
        });
        assert!(
            msg.contains("scale: non-finite value -inf at index 1"),
            "{msg}"
        );
    }

    #[test]
    fn the_worst_element_is_named() {
        let worst = worst_difference("x", &[1.0f32, 2.5, 3.0], &[1.0f32, 2.0, 3.1]);
        assert_eq!(worst.index, 1);
        assert_eq!(
            (worst.actual, worst.expected, worst.difference),
            (2.5, 2.0, 0.5)
        );
        let msg = panics(|| {
            assert_close("x", &[1.0f32, 2.5, 3.0], &[1.0f32, 2.0, 3.0], 1e-3);
        });
        assert!(
            msg.contains("worst at index 1: actual 2.5e0, expected 2e0"),
            "{msg}"
        );
    }

    #[test]
    fn relative_error_is_over_the_largest_expected_magnitude() {
        let e = relative_error("x", &[1.0f32, -4.1], &[1.0f32, -4.0]);
        assert!((e - 0.1 / 4.0).abs() < 1e-6, "{e}");
        assert_eq!(relative_error::<f32, f32>("empty", &[], &[]), 0.0);
        let (e, _) = relative_error_with_floor("x", &[0.5f64], &[0.0f64], 1.0);
        assert_eq!(e, 0.5);
    }

    #[test]
    fn lengths_must_agree() {
        let msg = panics(|| {
            relative_error("x", &[1.0f32], &[1.0f32, 2.0]);
        });
        assert!(msg.contains("1 values against 2 expected"), "{msg}");
    }
}
