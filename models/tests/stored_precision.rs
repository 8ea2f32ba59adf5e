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

#[test]
fn a_weight_that_must_be_converted_waits_for_its_first_use_and_clones_share_it() {
    let (d_in, d_out) = (48, 40);
    let w = values(d_out * d_in, 6);
    let b = values(d_out, 7);
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(
        dir.path(),
        &[
            ("l.weight", Dtype::F16, vec![d_out, d_in], bytes_f16(&w)),
            ("l.bias", Dtype::F16, vec![d_out], bytes_f16(&b)),
        ],
    );
    let vb = builder(&path);

    // Held as stored: the mapped file, made at load.
    let as_stored = Linear::load(
        &vb.clone().with_dtype(FloatDType::F16).pp("l"),
        d_in,
        d_out,
        true,
    )
    .unwrap();
    assert!(as_stored.weight.is_initialized());

    // Converted into bf16: found and checked at load, converted at the first forward.
    let converted = Linear::load(
        &vb.clone().with_dtype(FloatDType::BF16).pp("l"),
        d_in,
        d_out,
        true,
    )
    .unwrap();
    assert!(!converted.weight.is_initialized());
    assert!(!converted.bias.as_ref().unwrap().is_initialized());
    assert_eq!(converted.dims(), [d_in, d_out]);
    let clone = converted.clone();
    let x = Tensor::<B, 2>::from_data(
        TensorData::new(values(3 * d_in, 8), [3, d_in]),
        &Default::default(),
    )
    .cast(FloatDType::BF16);
    let out = converted.forward(x.clone()).into_data();
    assert!(converted.weight.is_initialized());
    assert!(!clone.weight.is_initialized());
    assert_eq!(clone.forward(x).into_data(), out);
    // The clone made before the first use holds the same converted bytes, not a second copy.
    assert!(Arc::ptr_eq(
        &flex(converted.weight.val()).data_arc(),
        &flex(clone.weight.val()).data_arc()
    ));

    // The values are those of reading at once: the stored f16 rounded to bf16, transposed.
    let at_once = vb
        .clone()
        .with_dtype(FloatDType::BF16)
        .pp("l")
        .get_linear_weight("weight", d_in, d_out)
        .unwrap();
    assert_eq!(at_once.dtype(), DType::BF16);
    assert_eq!(converted.weight.val().into_data(), at_once.into_data());
}

#[test]
fn a_weight_of_the_wrong_shape_is_refused_at_load_even_when_its_conversion_waits() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(
        dir.path(),
        &[(
            "l.weight",
            Dtype::F16,
            vec![5, 3],
            bytes_f16(&values(15, 9)),
        )],
    );
    let vb = builder(&path).with_dtype(FloatDType::BF16);
    let err = Linear::load(&vb.pp("l"), 4, 5, false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("l.weight") && err.contains("[5, 4]"), "{err}");
    let err = vb.param::<2>("missing", [2, 2]).unwrap_err().to_string();
    assert!(err.contains("missing"), "{err}");
}
