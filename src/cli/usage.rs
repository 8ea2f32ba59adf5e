//! Checks of the command line made before any model loads: numbers that must be finite, image
//! sizes that must divide by 8 and stay under a pixel limit, step counts, and flags that only
//! make sense together. A failed check is a [`UsageError`] (exit status 2).

/// A command line that cannot run, with the fix in the message; the binaries exit 2 on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

impl UsageError {
    fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

/// The most pixels an image may have unless `--max-pixels` raises it: 2048 x 2048, four times
/// SDXL's native size. Larger images need memory that grows with the square of the pixel count
/// in attention, so the default refuses them before anything is allocated.
pub const DEFAULT_MAX_PIXELS: u64 = 2048 * 2048;

/// The most denoising steps a run may ask for; far more than any scheduler needs, and small
/// enough that the step tables stay a few hundred kilobytes.
pub const MAX_STEPS: usize = 10_000;

/// Image sides must be multiples of this (the VAE's downsampling factor).
pub const SIZE_MULTIPLE: usize = 8;

/// `value` of `flag` when it is a finite number.
pub fn finite(flag: &str, value: f64) -> Result<f64, UsageError> {
    if value.is_finite() {
        Ok(value)
    } else {
        Err(UsageError::new(format!(
            "give {flag} a finite number (it was {value})"
        )))
    }
}

/// `value` of `flag` (e.g. img2img's `--strength`) when it lies in (0, 1].
pub fn unit_interval(flag: &str, value: f64) -> Result<f64, UsageError> {
    if value.is_finite() && value > 0.0 && value <= 1.0 {
        Ok(value)
    } else {
        Err(UsageError::new(format!(
            "{flag} must be in (0, 1]: pass a fraction of the steps to run such as 0.75 (it was \
             {value})"
        )))
    }
}

/// `steps` (from `source`, e.g. `--steps`) when it is 1 to [`MAX_STEPS`].
pub fn steps(source: &str, steps: usize) -> Result<usize, UsageError> {
    if (1..=MAX_STEPS).contains(&steps) {
        Ok(steps)
    } else {
        Err(UsageError::new(format!(
            "give {source} 1 to {MAX_STEPS} steps (it was {steps})"
        )))
    }
}

/// Checks a requested image size (either side may be left to the model's default): each side a
/// positive multiple of 8, and at most `max_pixels` pixels in all (`--max-pixels` raises it),
/// with the arithmetic checked for overflow. `source` names where the size came from.
pub fn image_size(
    source: &str,
    width: Option<usize>,
    height: Option<usize>,
    max_pixels: u64,
) -> Result<(), UsageError> {
    for (name, side) in [("width", width), ("height", height)] {
        if let Some(side) = side {
            if side == 0 || side % SIZE_MULTIPLE != 0 {
                let down = side / SIZE_MULTIPLE * SIZE_MULTIPLE;
                let up = side
                    .checked_next_multiple_of(SIZE_MULTIPLE)
                    .unwrap_or(down)
                    .max(SIZE_MULTIPLE);
                let nearest = if down == 0 || down == up {
                    up.to_string()
                } else {
                    format!("{down} or {up}")
                };
                return Err(UsageError::new(format!(
                    "use a {name} of {nearest}: sides must be multiples of {SIZE_MULTIPLE} ({source} \
                     gave {side})"
                )));
            }
        }
    }
    // A missing side is bounded by the other one alone here; the model's default fills it in.
    let pixels = (width.unwrap_or(1) as u64).checked_mul(height.unwrap_or(1) as u64);
    match pixels {
        Some(p) if p <= max_pixels => Ok(()),
        _ => Err(UsageError::new(format!(
            "pass --max-pixels N to allow {}x{} ({source}): images are limited to {max_pixels} \
             pixels (2048x2048 by default)",
            width.map_or("default".into(), |w| w.to_string()),
            height.map_or("default".into(), |h| h.to_string()),
        ))),
    }
}

/// Pixels of a `width x height` image when the product fits in `u64` and under `max_pixels`.
pub fn pixels_within(width: usize, height: usize, max_pixels: u64) -> Option<u64> {
    (width as u64)
        .checked_mul(height as u64)
        .filter(|&p| p <= max_pixels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_must_divide_by_8_and_stay_under_the_limit() {
        assert!(image_size("--width", Some(512), Some(768), DEFAULT_MAX_PIXELS).is_ok());
        assert!(image_size("--width", None, None, DEFAULT_MAX_PIXELS).is_ok());
        let odd = image_size("--width", Some(60), None, DEFAULT_MAX_PIXELS).unwrap_err();
        assert!(odd.0.starts_with("use a width of 56 or 64"), "{odd}");
        let zero = image_size("--height", None, Some(0), DEFAULT_MAX_PIXELS).unwrap_err();
        assert!(zero.0.starts_with("use a height of 8"), "{zero}");
        let huge = image_size(
            "--width",
            Some(usize::MAX - 7),
            Some(usize::MAX - 7),
            u64::MAX,
        );
        assert!(huge.unwrap_err().0.starts_with("pass --max-pixels"));
        let big = image_size("--width", Some(4096), Some(4096), DEFAULT_MAX_PIXELS);
        assert!(big.unwrap_err().0.contains("4096x4096"));
        assert!(image_size("--width", Some(4096), Some(4096), 4096 * 4096).is_ok());
    }

    #[test]
    fn non_finite_numbers_and_step_counts_are_refused() {
        assert!(finite("--guidance", f64::NAN).is_err());
        assert!(finite("--guidance", f64::INFINITY).is_err());
        assert_eq!(finite("--guidance", 7.5), Ok(7.5));
        assert!(unit_interval("--strength", 0.0).is_err());
        assert!(unit_interval("--strength", f64::NAN).is_err());
        assert_eq!(unit_interval("--strength", 1.0), Ok(1.0));
        assert!(steps("--steps", 0).is_err());
        assert!(steps("--steps", MAX_STEPS + 1).is_err());
        assert_eq!(steps("--steps", 50), Ok(50));
    }
}
