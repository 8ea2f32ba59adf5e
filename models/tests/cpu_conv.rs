//! `cpu::conv`, the burn-flex f32 fast path of `nn::Conv2d`, against Burn's own `conv2d` on the
//! same backend: random shapes with padding, stride 2, 1x1 and 5x5 kernels, batch > 1, several
//! row tiles, with and without bias, on the im2col and the Winograd path; and the fallback for
//! what it does not cover.
//!
//! Tolerance 1e-5 relative to the output's largest magnitude for im2col (the same products in
//! f32, summed in another order) and 2e-5 for Winograd (its transforms add a few roundings per
//! value).

use burn::tensor::module::conv2d as burn_conv2d;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_flex::Flex;
use oxidiff_models::cpu::conv::{conv2d_with, ConvGeometry, ConvPath};

type B = Flex;

/// Deterministic values in [-1, 1) from a 64-bit LCG.
fn random(shape: &[usize], seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..shape.iter().product::<usize>())
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn tensor<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    Tensor::from_data(
        TensorData::new(random(&shape, seed), shape),
        &Default::default(),
    )
}

/// One case: `[n, c_in, h, w]` convolved by `c_out` kernels of `k x k`.
#[allow(clippy::too_many_arguments)]
fn check(n: usize, c_in: usize, h: usize, w: usize, c_out: usize, k: usize, s: usize, p: usize) {
    check_path(ConvPath::Im2col, [n, c_in, h, w], c_out, k, s, p, true);
}

#[allow(clippy::too_many_arguments)]
fn check_path(
    path: ConvPath,
    [n, c_in, h, w]: [usize; 4],
    c_out: usize,
    k: usize,
    s: usize,
    p: usize,
    bias: bool,
) {
    let seed = (n * 1000 + c_in * 100 + h * 10 + w + c_out + k + s + p) as u64;
    let x = tensor([n, c_in, h, w], seed);
    let weight = tensor([c_out, c_in, k, k], seed + 1);
    let b = bias.then(|| tensor([c_out], seed + 2));
    let expected = burn_conv2d(
        x.clone(),
        weight.clone(),
        b.clone(),
        ConvOptions::new([s, s], [p, p], [1, 1], 1),
    );
    let got = conv2d_with(
        x,
        weight,
        b,
        ConvGeometry {
            stride: s,
            padding: p,
        },
        path,
    )
    .unwrap_or_else(|_| panic!("burn-flex f32 must take the fast path"));
    assert_eq!(got.dims(), expected.dims(), "output shape");
    let got = got.into_data().to_vec::<f32>().unwrap();
    let expected = expected.into_data().to_vec::<f32>().unwrap();
    let tol = if path == ConvPath::Winograd {
        2e-5
    } else {
        1e-5
    };
    oxidiff_test_support::assert_close_with_floor(
        &format!("{path:?}: n {n} c_in {c_in} {h}x{w} c_out {c_out} k {k} s {s} p {p}"),
        &got,
        &expected,
        tol,
        1e-6,
    );
}

#[test]
fn conv3x3_same_padding_matches_burn() {
    check(1, 3, 7, 9, 5, 3, 1, 1);
    check(2, 16, 12, 12, 24, 3, 1, 1);
    check(1, 4, 1, 1, 3, 3, 1, 1);
}

#[test]
fn conv3x3_stride2_with_and_without_padding_matches_burn() {
    check(2, 4, 8, 8, 6, 3, 2, 1);
    check(2, 8, 9, 7, 4, 3, 2, 0);
    check_path(ConvPath::Im2col, [1, 5, 10, 11], 7, 3, 2, 1, false);
}

#[test]
fn pointwise_and_5x5_kernels_match_burn() {
    check(2, 16, 5, 6, 8, 1, 1, 0);
    check(1, 3, 6, 6, 4, 5, 1, 2);
    check(1, 3, 6, 6, 4, 1, 2, 0);
    check(1, 2, 4, 4, 3, 3, 1, 3);
}

#[test]
fn several_row_tiles_and_no_bias_match_burn() {
    // 1024 output columns a tile: 27 rows of 37, so 40 rows make two tiles per sample.
    check_path(ConvPath::Im2col, [2, 6, 40, 37], 10, 3, 1, 1, false);
    check(3, 2, 70, 20, 3, 3, 1, 1);
}

#[test]
fn narrow_layers_on_several_threads_match_burn() {
    // With 2 or more threads, an 8x8 or 16x16 output would make tiles under 256 positions:
    // those run one sample at a time with gemm splitting the product (1 thread: row tiles).
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            check(2, 64, 8, 8, 96, 3, 1, 1);
            check(2, 32, 16, 16, 40, 1, 1, 0);
            check(1, 8, 16, 16, 8, 3, 2, 1);
            check_path(ConvPath::Im2col, [3, 20, 16, 12], 24, 3, 1, 1, false);
        });
    }
}

#[test]
fn winograd_3x3_matches_burn() {
    // `Winograd` takes F(4x4, 3x3) from 32x32 planes (positions for two samples), F(2x2, 3x3)
    // below; `WinogradF2` F(2x2, 3x3) throughout.
    for path in [ConvPath::Winograd, ConvPath::WinogradF2] {
        check_path(path, [2, 16, 24, 24], 24, 3, 1, 1, true);
        // Odd height and width (part tiles at the edges), no bias.
        check_path(path, [1, 5, 33, 35], 7, 3, 1, 1, false);
        check_path(path, [1, 4, 34, 31], 6, 3, 1, 1, true);
        // Two chunks of tile rows per sample.
        check_path(path, [2, 3, 40, 37], 10, 3, 1, 1, true);
        check_path(path, [1, 3, 70, 66], 5, 3, 1, 1, true);
        // The SD 1.5 VAE's width: 512 input channels summed per output.
        check_path(path, [1, 512, 32, 32], 16, 3, 1, 1, true);
    }
}

#[test]
fn f64_and_mixed_tensors_fall_back_to_burn() {
    // Mixed dtypes are left to Burn (bf16 and f16 alone are `cpu_half.rs`'s).
    let mixed = conv2d_with(
        tensor([1, 2, 4, 4], 1).cast(FloatDType::BF16),
        tensor([3, 2, 3, 3], 2),
        None,
        ConvGeometry {
            stride: 1,
            padding: 1,
        },
        ConvPath::Winograd,
    );
    assert!(mixed.is_err(), "bf16 input, f32 weight");
    let x = tensor([1, 2, 4, 4], 1).cast(FloatDType::F64);
    let weight = tensor([3, 2, 3, 3], 2).cast(FloatDType::F64);
    let geometry = ConvGeometry {
        stride: 1,
        padding: 1,
    };
    let (x, weight, _) =
        conv2d_with(x, weight, None, geometry, ConvPath::Winograd).expect_err("f64 is not covered");
    // The inputs come back as they were, for Burn's conv2d.
    assert_eq!(x.dims(), [1, 2, 4, 4]);
    assert_eq!(weight.dims(), [3, 2, 3, 3]);
}

#[test]
fn mismatched_channels_fall_back_to_burn() {
    let x = tensor([1, 2, 4, 4], 1);
    let weight = tensor([3, 5, 3, 3], 2);
    let geometry = ConvGeometry {
        stride: 1,
        padding: 1,
    };
    assert!(conv2d_with(x.clone(), weight.clone(), None, geometry, ConvPath::Im2col).is_err());
    // `Burn` always hands back.
    let weight = tensor([3, 2, 3, 3], 2);
    assert!(conv2d_with(x, weight, None, geometry, ConvPath::Burn).is_err());
}

/// Resident bytes of the mapping that holds `address` (`Rss` of its `/proc/self/smaps` entry).
#[cfg(target_os = "linux")]
fn resident_bytes_of_mapping(address: usize) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((start, end)) = first.split_once('-') {
            if let (Ok(start), Ok(end)) = (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) {
                inside = (start..end).contains(&address);
                continue;
            }
        }
        if inside {
            if let Some(kb) = line.strip_prefix("Rss:") {
                let kb: usize = kb.trim().trim_end_matches("kB").trim().parse().unwrap();
                return kb * 1024;
            }
        }
    }
    panic!("no mapping holds {address:#x}");
}

/// A Winograd weight whose transform is too large to keep beside it (over 64 MiB in f32) is kept
/// in place of its pages when the weight is the mapped checkpoint: the mapping's pages are handed
/// back after the first call, the weight still reads back unchanged, and the output is bit for
/// bit the one of the same weight in owned memory (transformed on every call), within 2e-5 of
/// an f64 convolution on sampled channels.
#[cfg(target_os = "linux")]
#[test]
fn winograd_transform_takes_the_place_of_a_mapped_weight() {
    use oxidiff_models::weights::Weights;
    use safetensors::tensor::{Dtype, TensorView};

    // 16 * 1040 * 1024 * 4 bytes of transform: over 64 MiB.
    let (c_out, c_in, side) = (1040, 1024, 16);
    let values = random(&[c_out, c_in, 3, 3], 7);
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("conv.safetensors");
    let view = TensorView::new(Dtype::F32, vec![c_out, c_in, 3, 3], &bytes).unwrap();
    safetensors::serialize_to_file([("w", view)], None, &path).unwrap();
    drop(bytes);

    let weights = Weights::from_files(std::slice::from_ref(&path)).unwrap();
    let data = weights.read("w", FloatDType::F32).unwrap();
    let address = data.as_bytes().as_ptr() as usize;
    // Read once, as a model's first use of its weights does, so that its pages are resident.
    let touched = data.as_bytes().iter().step_by(4096).fold(0u8, |a, b| a ^ b);
    std::hint::black_box(touched);
    let mapped = Tensor::<B, 4>::from_data(data, &Default::default());
    let owned = Tensor::<B, 4>::from_data(
        TensorData::new(values.clone(), [c_out, c_in, 3, 3]),
        &Default::default(),
    );
    let x = tensor([1, c_in, side, side], 8);
    let geometry = ConvGeometry {
        stride: 1,
        padding: 1,
    };
    let run = |weight: &Tensor<B, 4>| {
        conv2d_with(
            x.clone(),
            weight.clone(),
            None,
            geometry,
            ConvPath::Winograd,
        )
        .unwrap_or_else(|_| panic!("burn-flex f32 must take the fast path"))
        .into_data()
        .to_vec::<f32>()
        .unwrap()
    };

    let resident_before = resident_bytes_of_mapping(address);
    let first = run(&mapped);
    let resident_after = resident_bytes_of_mapping(address);
    assert!(
        resident_before > 30 << 20 && resident_after < 1 << 20,
        "the mapped weight's pages: {resident_before} bytes resident before the call, \
         {resident_after} after"
    );
    assert_eq!(run(&mapped), first, "the kept transform's second call");
    assert_eq!(run(&owned), first, "the same weight in owned memory");
    assert_eq!(
        mapped.into_data().to_vec::<f32>().unwrap(),
        values,
        "the weight read back after its pages were handed back"
    );

    let x = x.into_data().to_vec::<f32>().unwrap();
    let plane = side * side;
    let mut got = Vec::new();
    let mut expected = Vec::new();
    for co in [0, 517, c_out - 1] {
        got.extend_from_slice(&first[co * plane..(co + 1) * plane]);
        expected.extend(conv3x3_f64(&x, &values, [c_in, side, side], co));
    }
    oxidiff_test_support::assert_close_with_floor(
        "Winograd, mapped 1040x1024 weight, against f64",
        &got,
        &expected,
        2e-5,
        1e-6,
    );
}

/// Output channel `co` of a 3x3, stride 1, padding 1 convolution of one sample `x` `[c_in, h,
/// w]` with `weight` `[c_out, c_in, 3, 3]`, summed in f64.
fn conv3x3_f64(x: &[f32], weight: &[f32], [c_in, h, w]: [usize; 3], co: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(h * w);
    for y in 0..h {
        for xx in 0..w {
            let mut sum = 0.0f64;
            for c in 0..c_in {
                for (dy, dx) in (0..3).flat_map(|dy| (0..3).map(move |dx| (dy, dx))) {
                    let (iy, ix) = (y as isize + dy - 1, xx as isize + dx - 1);
                    if (0..h as isize).contains(&iy) && (0..w as isize).contains(&ix) {
                        let input = x[(c * h + iy as usize) * w + ix as usize] as f64;
                        let k = weight[((co * c_in + c) * 3 + dy as usize) * 3 + dx as usize];
                        sum += input * k as f64;
                    }
                }
            }
            out.push(sum as f32);
        }
    }
    out
}

/// Both Winograd tilings against an f64 convolution on odd shapes (part tiles at the right and
/// bottom edges, planes that are no multiple of 4), within 1e-5 of the output's largest
/// magnitude.
#[test]
fn winograd_tilings_match_f64_on_odd_shapes() {
    for path in [ConvPath::Winograd, ConvPath::WinogradF2] {
        for (i, &[n, c_in, h, w, c_out]) in
            [[1, 7, 37, 35, 5], [2, 64, 33, 34, 9], [1, 3, 45, 64, 4]]
                .iter()
                .enumerate()
        {
            let x = random(&[n, c_in, h, w], 40 + i as u64);
            let weight = random(&[c_out, c_in, 3, 3], 50 + i as u64);
            let got = conv2d_with(
                Tensor::<B, 4>::from_data(
                    TensorData::new(x.clone(), [n, c_in, h, w]),
                    &Default::default(),
                ),
                Tensor::<B, 4>::from_data(
                    TensorData::new(weight.clone(), [c_out, c_in, 3, 3]),
                    &Default::default(),
                ),
                None,
                ConvGeometry {
                    stride: 1,
                    padding: 1,
                },
                path,
            )
            .unwrap_or_else(|_| panic!("burn-flex f32 must take the fast path"))
            .into_data()
            .to_vec::<f32>()
            .unwrap();
            let sample = c_in * h * w;
            let expected: Vec<f32> = (0..n)
                .flat_map(|b| {
                    let x = &x[b * sample..(b + 1) * sample];
                    let weight = &weight;
                    (0..c_out).flat_map(move |co| conv3x3_f64(x, weight, [c_in, h, w], co))
                })
                .collect();
            oxidiff_test_support::assert_close_with_floor(
                &format!("{path:?}: n {n} c_in {c_in} {h}x{w} c_out {c_out} against f64"),
                &got,
                &expected,
                1e-5,
                1e-6,
            );
        }
    }
}

/// The slice entry points a compiled program's host kernels call (`conv2d_f32_slices`,
/// `attention_f32_slices`, `matmul_f32_slices`) refuse buffers whose lengths do not match the shapes they are
/// given, and shapes that are not a convolution, with an error rather than a panic or a read
/// out of bounds; matching buffers give the tensor kernel's result.
#[test]
fn slice_kernels_refuse_buffers_that_do_not_match_their_shapes() {
    use oxidiff_models::cpu::attention::{attention_f32_slices, Masking};
    use oxidiff_models::cpu::conv::conv2d_f32_slices;
    let geometry = ConvGeometry {
        stride: 1,
        padding: 1,
    };
    let (x, w) = (vec![0.5f32; 2 * 3 * 5 * 5], vec![0.25f32; 4 * 3 * 3 * 3]);
    let mut out = vec![0.0f32; 2 * 4 * 5 * 5];
    let conv = |x: &[f32], w: &[f32], wd: [usize; 4], out: &mut [f32]| {
        conv2d_f32_slices(x, [2, 3, 5, 5], w, wd, None, geometry, out)
    };
    assert!(conv(&x[1..], &w, [4, 3, 3, 3], &mut out)
        .unwrap_err()
        .contains("input"));
    assert!(conv(&x, &w[1..], [4, 3, 3, 3], &mut out)
        .unwrap_err()
        .contains("kernel"));
    assert!(conv(&x, &w, [4, 3, 3, 3], &mut out[1..])
        .unwrap_err()
        .contains("output"));
    assert!(
        conv(&x, &w, [4, 2, 3, 3], &mut out).is_err(),
        "channels differ"
    );
    assert!(conv(&x, &w, [4, 3, 3, 2], &mut out).is_err(), "not square");
    let bias = [1.0, 2.0, 3.0, 4.0];
    let conv_bias = |bias: &[f32], out: &mut [f32]| {
        conv2d_f32_slices(
            &x,
            [2, 3, 5, 5],
            &w,
            [4, 3, 3, 3],
            Some(bias),
            geometry,
            out,
        )
    };
    assert!(conv_bias(&bias[1..], &mut out)
        .unwrap_err()
        .contains("bias"));
    conv_bias(&bias, &mut out).unwrap();
    // The centre of the last channel's plane of the second sample: 3.375 plus its bias.
    assert_eq!(out[(2 * 4 - 1) * 25 + 2 * 5 + 2], 3.375 + 4.0);
    out.fill(f32::NAN);
    conv(&x, &w, [4, 3, 3, 3], &mut out).unwrap();
    // The centre of a plane sees all 27 taps: 27 * 0.5 * 0.25.
    assert_eq!(out[2 * 5 + 2], 3.375);
    assert!(
        out.iter().all(|v| v.is_finite()),
        "the output is overwritten, not added to"
    );

    let q = vec![0.1f32; 2 * 3 * 8];
    let mut o = vec![0.0f32; q.len()];
    let attend = |k: &[f32], o: &mut [f32], masking| {
        attention_f32_slices(&q, k, k, [2, 3, 3, 2, 4], masking, o)
    };
    assert!(attend(&q[1..], &mut o, Masking::None)
        .unwrap_err()
        .contains("keys"));
    assert!(attend(&q, &mut o[1..], Masking::None)
        .unwrap_err()
        .contains("output"));
    assert!(attention_f32_slices(
        &q,
        &q[..16],
        &q[..16],
        [2, 3, 2, 2, 4],
        Masking::Causal,
        &mut o
    )
    .is_err());
    attend(&q, &mut o, Masking::None).unwrap();
    assert!(
        o.iter().all(|v| (v - 0.1).abs() < 1e-6),
        "uniform values attend to themselves"
    );

    // [3, 5] x [5, 2]: a[i][j] = i + j, b[j][c] = c + 1.
    use oxidiff_models::cpu::linear::matmul_f32_slices;
    let a: Vec<f32> = (0..15).map(|i| (i / 5 + i % 5) as f32).collect();
    let b: Vec<f32> = (0..10).map(|i| (i % 2 + 1) as f32).collect();
    let mut p = vec![f32::NAN; 6];
    assert!(matmul_f32_slices(&a[1..], &b, None, [3, 5, 2], &mut p)
        .unwrap_err()
        .contains("left side"));
    assert!(matmul_f32_slices(&a, &b[1..], None, [3, 5, 2], &mut p)
        .unwrap_err()
        .contains("right side"));
    assert!(matmul_f32_slices(&a, &b, None, [3, 5, 2], &mut p[1..])
        .unwrap_err()
        .contains("output"));
    assert!(matmul_f32_slices(&a, &b, Some(&[1.0]), [3, 5, 2], &mut p)
        .unwrap_err()
        .contains("bias"));
    matmul_f32_slices(&a, &b, None, [3, 5, 2], &mut p).unwrap();
    // Row i sums 5 i + 10, times 1 and 2; the NaNs were overwritten.
    assert_eq!(p, [10.0, 20.0, 15.0, 30.0, 20.0, 40.0]);
    p.fill(f32::NAN);
    matmul_f32_slices(&a, &b, Some(&[0.5, -1.0]), [3, 5, 2], &mut p).unwrap();
    assert_eq!(p, [10.5, 19.0, 15.5, 29.0, 20.5, 39.0]);
}
