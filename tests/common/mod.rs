//! Shared helpers of the parity tests: the fixtures made by `tools/golden/make_tiny_sd.py`.
#![allow(dead_code)]

pub mod cli;
pub mod golden_run;
pub mod half;

use std::path::PathBuf;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff::models::Weights;

// Not every test binary that includes this module runs a binary.
#[allow(unused_imports)]
pub use cli::{copy_dir, files_in, stderr, txt2img, txt2img_env};

pub type B = oxidiff::Cpu;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A tiny pipeline folder (`tiny-sd1`, `tiny-sd2`).
pub fn model_dir(name: &str) -> PathBuf {
    fixtures().join(name)
}

/// The golden tensors and settings diffusers produced for a tiny pipeline.
pub struct Golden {
    pub name: String,
    pub tensors: Weights,
    pub json: serde_json::Value,
}

impl Golden {
    pub fn load(name: &str) -> Self {
        let dir = fixtures().join("golden");
        let tensors = Weights::from_files(&[dir.join(format!("{name}.safetensors"))])
            .expect("golden tensors load");
        let text = std::fs::read_to_string(dir.join(format!("{name}.json"))).expect("golden json");
        Self {
            name: name.to_string(),
            tensors,
            json: serde_json::from_str(&text).expect("golden json parses"),
        }
    }

    pub fn host(&self, key: &str) -> (Vec<f32>, Vec<usize>) {
        self.tensors
            .read_f32(key)
            .unwrap_or_else(|e| panic!("golden key {key}: {e}"))
    }

    /// An int64 `[rows, len]` golden tensor of token ids.
    pub fn token_rows(&self, key: &str) -> Vec<Vec<u32>> {
        let path = fixtures()
            .join("golden")
            .join(format!("{}.safetensors", self.name));
        let bytes = std::fs::read(path).expect("golden file");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("golden parses");
        let view = st.tensor(key).expect("golden key");
        let len = view.shape()[1];
        let ids: Vec<u32> = view
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")) as u32)
            .collect();
        ids.chunks(len).map(<[u32]>::to_vec).collect()
    }

    pub fn tensor<const D: usize>(&self, key: &str) -> Tensor<B, D> {
        let (values, shape) = self.host(key);
        let shape: [usize; D] = shape.try_into().expect("golden rank");
        Tensor::from_data(
            burn::tensor::TensorData::new(values, shape),
            &Default::default(),
        )
    }
}

/// Largest absolute difference divided by the largest absolute reference value; panics, naming
/// the element, at a NaN or infinity on either side (see [`oxidiff_test_support`]).
pub fn relative_error(actual: &[f32], expected: &[f32]) -> f32 {
    oxidiff_test_support::relative_error("output", actual, expected) as f32
}

pub fn to_vec<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 data")
}

/// Asserts `actual` matches the golden `key` within `tol` relative error (see [`relative_error`]).
pub fn assert_close<const D: usize>(golden: &Golden, key: &str, actual: Tensor<B, D>, tol: f32) {
    let (expected, shape) = golden.host(key);
    assert_eq!(actual.dims().to_vec(), shape, "{key}: shape");
    let err = oxidiff_test_support::assert_close(key, &to_vec(actual), &expected, f64::from(tol));
    eprintln!("{key}: relative error {err:e}");
}

/// Asserts an 8-bit RGB image is within `levels` per channel of the golden PNG `name`.
pub fn assert_png_close(ours: &image::RgbImage, name: &str, levels: u8) {
    let reference = image::open(fixtures().join("golden").join(name))
        .expect("golden PNG")
        .to_rgb8();
    let max_diff = png_level_diff(ours, &reference);
    assert!(max_diff <= levels, "{name}: differs by {max_diff} levels");
    eprintln!("{name}: max difference {max_diff} levels");
}

/// The largest per-channel difference of two 8-bit RGB images of the same size.
pub fn png_level_diff(a: &image::RgbImage, b: &image::RgbImage) -> u8 {
    assert_eq!(a.dimensions(), b.dimensions(), "image sizes differ");
    a.as_raw()
        .iter()
        .zip(b.as_raw())
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0)
}
