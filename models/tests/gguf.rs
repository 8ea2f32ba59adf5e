//! GGUF files: every GGML type oxidiff reads dequantizes to exactly what gguf-py's
//! `gguf.quants.dequantize` gives (bit for bit, on gguf-py's own blocks and on random K-type
//! blocks); a Linear on quantized blocks computes `x W^T + b` with the dense product's values
//! in f32 and bf16, without ever making the dense weight; and broken or hostile files (unknown
//! type, truncated data, absurd dimensions, a metadata bomb, wrong magic or version) end in a
//! one-line error naming the file and the tensor, before anything large is allocated.
//! Fixtures of `tools/golden/make_gguf.py`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_flex::Flex;
use oxidiff_models::gguf::GgmlType;
use oxidiff_models::nn::Linear;
use oxidiff_models::weights::{TensorView, Weights};
use oxidiff_models::ToDType;
use oxidiff_models::VarBuilder;

type B = Flex;

const TYPES: [&str; 13] = [
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K",
];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf")
}

#[test]
fn every_type_dequantizes_as_gguf_py_bit_for_bit() {
    let gguf = Weights::from_gguf(&fixtures().join("blocks.gguf")).unwrap();
    let expected =
        Weights::from_standalone_file(&fixtures().join("blocks-dequantized.safetensors")).unwrap();
    for name in TYPES {
        let (ours, shape) = gguf.read_f32(name).unwrap();
        let (theirs, their_shape) = expected.read_f32(name).unwrap();
        assert_eq!(shape, their_shape, "{name}");
        assert_eq!(shape, [3, 512], "{name}");
        let differ = ours
            .iter()
            .zip(&theirs)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(differ, None, "{name}: first differing value");
        let quantized = gguf.quantized(name).unwrap();
        assert_eq!(
            quantized.map(|q| q.kind().to_string()),
            (!name.starts_with(['F', 'B'])).then(|| name.to_string()),
            "{name} kept in blocks"
        );
    }
}

/// A Linear reading quantized tensor `name` of the blocks file as its `[3, 512]` weight, with
/// the dequantized values.
fn quantized_linear(name: &str) -> (Linear<B>, Vec<f32>) {
    let gguf = Weights::from_gguf(&fixtures().join("blocks.gguf")).unwrap();
    let dense = gguf.read_f32(name).unwrap().0;
    let view = gguf
        .view([("l.weight".to_string(), name.to_string(), TensorView::Whole)])
        .unwrap();
    let vb = VarBuilder::<B>::new(Arc::new(view), &Default::default()).pp("l");
    (Linear::load(&vb, 512, 3, false).unwrap(), dense)
}

fn x_values(rows: usize) -> Vec<f32> {
    (0..rows * 512)
        .map(|i| ((i * 7919 % 1013) as f32 / 1013.0) - 0.5)
        .collect()
}

fn reference(x: &[f32], w: &[f32], rows: usize) -> Vec<f64> {
    let mut out = vec![0f64; rows * 3];
    for r in 0..rows {
        for o in 0..3 {
            out[r * 3 + o] = (0..512)
                .map(|i| f64::from(x[r * 512 + i]) * f64::from(w[o * 512 + i]))
                .sum();
        }
    }
    out
}

#[test]
fn quantized_linear_computes_the_dense_product_on_its_blocks() {
    for name in ["Q8_0", "Q4_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q6_K"] {
        let (linear, dense) = quantized_linear(name);
        assert_eq!(linear.dims(), [512, 3]);
        for rows in [1, 5, 300] {
            let x = x_values(rows);
            let input = Tensor::<B, 3>::from_data(
                TensorData::new(x.clone(), [1, rows, 512]),
                &Default::default(),
            );
            let out = linear.forward(input);
            assert_eq!(out.dims(), [1, rows, 3]);
            let ours = out.into_data().to_vec::<f32>().unwrap();
            let expected = reference(&x, &dense, rows);
            let scale = expected.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (a, e) in ours.iter().zip(&expected) {
                assert!(a.is_finite(), "{name}: non-finite output");
                assert!(
                    (f64::from(*a) - e).abs() <= 1e-5 * scale,
                    "{name} rows {rows}: {a} vs {e}"
                );
            }
        }
        assert!(!linear.weight.is_initialized(), "{name}: dense weight made");
    }
}

#[test]
fn quantized_linear_in_bf16_stays_in_blocks_and_rounds_once() {
    let (linear, dense) = quantized_linear("Q4_K");
    let linear = linear.to_dtype(FloatDType::BF16);
    assert!(
        !linear.weight.is_initialized(),
        "a cast keeps the weight in its blocks"
    );
    let x = x_values(4);
    let input =
        Tensor::<B, 2>::from_data(TensorData::new(x.clone(), [4, 512]), &Default::default())
            .cast(FloatDType::BF16);
    let out = linear.forward(input);
    assert_eq!(out.dtype(), DType::BF16);
    let ours = out
        .cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    // x was rounded to bf16 before the product: compare with that input.
    let xr: Vec<f32> = x
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_f32())
        .collect();
    let expected = reference(&xr, &dense, 4);
    let scale = expected.iter().fold(0f64, |m, v| m.max(v.abs()));
    for (a, e) in ours.iter().zip(&expected) {
        assert!((f64::from(*a) - e).abs() <= 8e-3 * scale, "{a} vs {e}");
    }
    // The lazy dense weight, when asked for, is the dequantized matrix in bf16 as [in, out].
    let w = linear.weight.val();
    assert_eq!((w.dims(), w.dtype()), ([512, 3], DType::BF16));
    let w = w.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap();
    assert_eq!(w[1], half::bf16::from_f32(dense[512]).to_f32());
}

// ------------------------------------------------------------------ hostile files

/// A GGUF v3 file: `kvs` already encoded, then tensor descriptions `(name, ne, type, offset)`,
/// then `data` at the 32-byte aligned data start.
fn gguf_bytes(
    kvs: &[(u64, Vec<u8>)],
    tensors: &[(&str, Vec<u64>, u32, u64)],
    data: &[u8],
) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kvs.len() as u64).to_le_bytes());
    for (_, kv) in kvs {
        b.extend(kv);
    }
    for (name, ne, kind, offset) in tensors {
        b.extend((name.len() as u64).to_le_bytes());
        b.extend(name.as_bytes());
        b.extend((ne.len() as u32).to_le_bytes());
        for n in ne {
            b.extend(n.to_le_bytes());
        }
        b.extend(kind.to_le_bytes());
        b.extend(offset.to_le_bytes());
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend(data);
    b
}

fn string_kv(key: &str, len: u64, value: &[u8]) -> (u64, Vec<u8>) {
    let mut b = (key.len() as u64).to_le_bytes().to_vec();
    b.extend(key.as_bytes());
    b.extend(8u32.to_le_bytes());
    b.extend(len.to_le_bytes());
    b.extend(value);
    (0, b)
}

fn open_error(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    let err = Weights::from_gguf(&path).unwrap_err().to_string();
    assert!(err.contains(name), "error names the file: {err}");
    assert!(!err.contains('\n'), "one line: {err}");
    // Nothing written or changed beside the file.
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    err
}

#[test]
fn broken_and_hostile_files_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let q8 = vec![0u8; 34 * 2];
    let good = gguf_bytes(&[], &[("w", vec![32, 2], 8, 0)], &q8);
    assert!(Weights::from_gguf(&{
        let p = d.join("good.gguf");
        std::fs::write(&p, &good).unwrap();
        p
    })
    .is_ok());

    let err = open_error(
        d,
        "iq.gguf",
        &gguf_bytes(&[], &[("w", vec![256, 2], 18, 0)], &q8),
    );
    assert!(err.contains("`w`") && err.contains("GGML type 18"), "{err}");

    let err = open_error(d, "short.gguf", &good[..good.len() - 5]);
    assert!(err.contains("`w`") && err.contains("truncated"), "{err}");

    let err = open_error(
        d,
        "huge.gguf",
        &gguf_bytes(&[], &[("w", vec![1 << 40, 1 << 40], 8, 0)], &q8),
    );
    assert!(err.contains("`w`") && err.contains("too large"), "{err}");

    let err = open_error(
        d,
        "rows.gguf",
        &gguf_bytes(&[], &[("w", vec![48, 2], 8, 0)], &q8),
    );
    assert!(err.contains("`w`") && err.contains("whole number"), "{err}");

    let err = open_error(
        d,
        "dims.gguf",
        &gguf_bytes(&[], &[("w", vec![32, 1, 1, 1, 2], 8, 0)], &q8),
    );
    assert!(err.contains("`w`") && err.contains("5 dimensions"), "{err}");

    // A string claiming 2^60 bytes, an array claiming 2^60 strings, 2^60 metadata entries.
    let err = open_error(
        d,
        "bomb.gguf",
        &gguf_bytes(&[string_kv("general.name", 1 << 60, b"x")], &[], &[]),
    );
    assert!(
        err.contains("general.name") && err.contains("truncated"),
        "{err}"
    );
    let mut array = (4u64).to_le_bytes().to_vec();
    array.extend(b"toks");
    array.extend(9u32.to_le_bytes());
    array.extend(8u32.to_le_bytes());
    array.extend((1u64 << 60).to_le_bytes());
    let err = open_error(d, "array.gguf", &gguf_bytes(&[(0, array)], &[], &[]));
    assert!(
        err.contains("toks") && err.contains("array elements"),
        "{err}"
    );
    let mut many = good.clone();
    many[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let err = open_error(d, "many.gguf", &many);
    assert!(err.contains("metadata entries"), "{err}");

    let mut magic = good.clone();
    magic[..4].copy_from_slice(b"GGML");
    assert!(open_error(d, "magic.gguf", &magic).contains("not a GGUF file"));
    let mut version = good.clone();
    version[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(open_error(d, "v1.gguf", &version).contains("version 1"));
}

#[test]
fn a_quantized_weight_of_the_wrong_shape_names_the_tensor() {
    let gguf = Weights::from_gguf(&fixtures().join("blocks.gguf")).unwrap();
    let view = gguf
        .view([(
            "l.weight".to_string(),
            "Q8_0".to_string(),
            TensorView::Whole,
        )])
        .unwrap();
    let vb = VarBuilder::<B>::new(Arc::new(view), &Default::default()).pp("l");
    let err = Linear::load(&vb, 256, 3, false).unwrap_err().to_string();
    assert!(
        err.contains("l.weight") && err.contains("blocks.gguf"),
        "{err}"
    );
    // Blocks run along rows: a quantized tensor cannot be read transposed.
    let err = gguf
        .view([("t".to_string(), "Q4_K".to_string(), TensorView::Transpose)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("Q4_K") && err.contains("quantized"), "{err}");
    assert_eq!(GgmlType::Q4_K.block(), (256, 144));
}
