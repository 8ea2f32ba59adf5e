//! Weights at their stored precision: every stored float type read into every held dtype gives
//! what reading f32 and casting gave (bit for bit); a tensor held in its stored dtype is the
//! mapped file itself, and writing into it copies first and leaves the file as it was; a Linear
//! on the checkpoint's `[out, in]` weight (a transposed view) computes `x W^T + b` on every
//! path (few rows, many rows, f32, bf16).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{AllocationProperty, DType, FloatDType, Tensor, TensorData};
use burn_flex::{Flex, FlexTensor};
use half::{bf16, f16};
use oxidiff_models::nn::Linear;
use oxidiff_models::weights::Weights;
use oxidiff_models::VarBuilder;
use safetensors::tensor::{Dtype, TensorView};

type B = Flex;

/// Deterministic values with fractions that f16 and bf16 must round.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
            (x % 20_011) as f32 / 7_919.0 - 1.263
        })
        .collect()
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn bytes_f16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| f16::from_f32(*x).to_le_bytes())
        .collect()
}
fn bytes_bf16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
        .collect()
}

/// A model folder `model/unet/diffusion_pytorch_model.safetensors` holding `tensors`.
fn checkpoint(root: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> PathBuf {
    let dir = root.join("model").join("unet");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("diffusion_pytorch_model.safetensors");
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.to_string(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

fn flex<const D: usize>(t: Tensor<B, D>) -> FlexTensor {
    t.into_primitive().tensor()
}

fn builder(path: &Path) -> VarBuilder<B> {
    let weights = Weights::from_files(&[path.to_path_buf()]).unwrap();
    VarBuilder::new(Arc::new(weights), &Default::default())
}

#[test]
fn every_stored_type_read_into_every_dtype_equals_reading_f32_and_casting() {
    let dir = tempfile::tempdir().unwrap();
    let v = values(6 * 7, 1);
    let path = checkpoint(
        dir.path(),
        &[
            ("a", Dtype::F32, vec![6, 7], bytes_f32(&v)),
            ("b", Dtype::F16, vec![6, 7], bytes_f16(&v)),
            ("c", Dtype::BF16, vec![6, 7], bytes_bf16(&v)),
        ],
    );
    let vb = builder(&path);
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        let held = vb.clone().with_dtype(dtype);
        for key in ["a", "b", "c"] {
            let read = held.get::<2>(key, [6, 7]).unwrap();
            assert_eq!(read.dtype(), DType::from(dtype), "{key} in {dtype:?}");
            let (f32_values, shape) = vb.weights().read_f32(key).unwrap();
            let cast =
                Tensor::<B, 2>::from_data(TensorData::new(f32_values, shape), &Default::default())
                    .cast(dtype);
            assert_eq!(
                read.into_data().as_bytes(),
                cast.into_data().as_bytes(),
                "{key} read into {dtype:?} differs from f32 then cast"
            );
        }
    }
}

#[test]
fn a_tensor_held_in_its_stored_dtype_is_the_mapped_file_and_writing_to_it_copies_first() {
    let dir = tempfile::tempdir().unwrap();
    let v = values(64, 2);
    let path = checkpoint(
        dir.path(),
        &[
            ("f32", Dtype::F32, vec![64], bytes_f32(&v)),
            ("f16", Dtype::F16, vec![64], bytes_f16(&v)),
        ],
    );
    let before = std::fs::read(&path).unwrap();
    let vb = builder(&path);
    let shared = vb.get::<1>("f32", [64]).unwrap();
    let storage = flex(shared.clone()).data_arc();
    assert_eq!(
        storage.property(),
        AllocationProperty::File,
        "f32 held in f32 is mapped"
    );
    let in_f16 = vb
        .clone()
        .with_dtype(FloatDType::F16)
        .get::<1>("f16", [64])
        .unwrap();
    assert_eq!(flex(in_f16).data_arc().property(), AllocationProperty::File);
    let converted = vb
        .clone()
        .with_dtype(FloatDType::F16)
        .get::<1>("f32", [64])
        .unwrap();
    assert_ne!(
        flex(converted).data_arc().property(),
        AllocationProperty::File
    );

    // burn-flex adds in place into storage nobody else holds: the mapped bytes are read-only,
    // so this must copy first (a write into the map would crash), and the file stays as it was.
    drop(storage);
    let plus_one = shared.add_scalar(1.0);
    let expected: Vec<f32> = v.iter().map(|x| x + 1.0).collect();
    assert_eq!(plus_one.into_data().to_vec::<f32>().unwrap(), expected);
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(
        vb.get::<1>("f32", [64])
            .unwrap()
            .into_data()
            .to_vec::<f32>()
            .unwrap(),
        v
    );
}

/// `x W^T + b` for `x` `[rows, d_in]`, `w` `[d_out, d_in]`, in f64.
fn reference(x: &[f32], w: &[f32], b: &[f32], rows: usize, d_in: usize) -> Vec<f32> {
    let d_out = b.len();
    let mut out = vec![0f32; rows * d_out];
    for r in 0..rows {
        for o in 0..d_out {
            let mut acc = b[o] as f64;
            for i in 0..d_in {
                acc += x[r * d_in + i] as f64 * w[o * d_in + i] as f64;
            }
            out[r * d_out + o] = acc as f32;
        }
    }
    out
}

#[test]
fn a_linear_on_the_checkpoint_layout_computes_x_w_transposed_plus_b_on_every_path() {
    let (d_in, d_out) = (48, 40);
    let w = values(d_out * d_in, 3);
    let b = values(d_out, 4);
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(
        dir.path(),
        &[
            ("l.weight", Dtype::F32, vec![d_out, d_in], bytes_f32(&w)),
            ("l.bias", Dtype::F32, vec![d_out], bytes_f32(&b)),
        ],
    );
    let vb = builder(&path);
    // 4 and 300 rows: either side of the few-rows f32 path; as [2, rows/2, d_in] and 2-D.
    let round = |v: &[f32]| -> Vec<f32> { v.iter().map(|x| bf16::from_f32(*x).to_f32()).collect() };
    for rows in [4, 300] {
        let x = values(rows * d_in, 5);
        for dtype in [FloatDType::F32, FloatDType::BF16] {
            // In bf16 the reference takes the same rounded inputs: what is left is the output's
            // rounding (2^-9 relative) and the order of the sums.
            let expected = match dtype {
                FloatDType::BF16 => reference(&round(&x), &round(&w), &round(&b), rows, d_in),
                _ => reference(&x, &w, &b, rows, d_in),
            };
            let linear =
                Linear::load(&vb.clone().with_dtype(dtype).pp("l"), d_in, d_out, true).unwrap();
            assert_eq!(linear.weight.val().dims(), [d_in, d_out]);
            let x2 = Tensor::<B, 2>::from_data(
                TensorData::new(x.clone(), [rows, d_in]),
                &Default::default(),
            )
            .cast(dtype);
            let x3 = x2.clone().reshape([2, rows / 2, d_in]);
            let tol = if dtype == FloatDType::F32 { 1e-5 } else { 8e-3 };
            for out in [
                linear.forward(x2).into_data(),
                linear.forward(x3).into_data(),
            ] {
                assert_eq!(out.num_elements(), rows * d_out);
                let out: Vec<f32> = out.convert::<f32>().to_vec().unwrap();
                let worst = out
                    .iter()
                    .zip(&expected)
                    .map(|(o, e)| (o - e).abs() / (1.0 + e.abs()))
                    .fold(0f32, f32::max);
                assert!(worst < tol, "{rows} rows in {dtype:?}: off by {worst}");
            }
        }
    }
}
