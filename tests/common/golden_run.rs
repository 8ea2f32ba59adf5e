//! Checks of a whole golden run (`tools/golden/make_inpaint.py`'s and `make_refiner.py`'s
//! cases, PNGs `GOLDEN-CASE.png`), shared by the inpainting and SDXL image-to-image tests.

use burn::tensor::Tensor;
use oxidiff::pipelines::Images;

use super::{assert_close, assert_png_close, relative_error, Golden, B};

/// 1 vs 2 torch threads already differ by about 1e-5 relative.
pub const TOL: f32 = 1e-4;

/// Timesteps exactly, per-step latents and the float image within [`TOL`], the PNG within 2
/// levels (shared with the SDXL tests' cases of the same golden file).
pub fn check_run(golden: &Golden, case: &str, steps: Vec<(f64, Tensor<B, 4>)>, images: Images) {
    let expected: Vec<f64> = golden.json["timesteps"][case]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(steps.iter().map(|(t, _)| *t).collect::<Vec<_>>(), expected);
    for (i, (_, latents)) in steps.into_iter().enumerate() {
        assert_close(golden, &format!("{case}.step{i}"), latents, TOL);
    }
    let (expected, _) = golden.host(&format!("{case}.image"));
    let err = relative_error(&images.data, &expected);
    eprintln!("{case}.image: relative error {err:e}");
    assert!(err <= TOL, "{case}: image relative error {err:e}");
    assert_png_close(
        &images.to_rgb8(0).unwrap(),
        &format!("{}-{case}.png", golden.name),
        2,
    );
}
