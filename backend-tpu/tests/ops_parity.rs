//! Each lowered op on the XLA CPU plugin against the same op on the CPU
//! device (burn-flex), on seeded random inputs of a few shapes.
//!
//! Tolerances are relative to the largest magnitude of the expected tensor:
//! f32 1e-5 (both sides compute in f32 but XLA vectorizes transcendental
//! functions and sums in a different order), bf16 1e-2 (one bf16 rounding of
//! the result is 2^-8 relative, and the two sides may round intermediate
//! values differently).

mod common;

use burn::tensor::activation::{gelu, relu, sigmoid, silu, softmax};
use burn::tensor::module::{attention, conv2d, embedding, interpolate, linear};
use burn::tensor::ops::{AttentionModuleOptions, ConvOptions, InterpolateMode, InterpolateOptions};
use burn::tensor::{Bool, DType, Distribution, IndexingUpdateOp, Int, Tensor, TensorData};
use oxidiff_backend_tpu::{Oxi, OxiDevice};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const F32_TOL: f32 = 1e-5;
const BF16_TOL: f32 = 1e-2;

/// Seeded values in [-2, 2).
fn host(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

fn input<const D: usize>(seed: u64, shape: [usize; D], device: &OxiDevice) -> Tensor<Oxi, D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(host(seed, n), shape), device)
}

fn positive<const D: usize>(seed: u64, shape: [usize; D], device: &OxiDevice) -> Tensor<Oxi, D> {
    input(seed, shape, device).abs() + 0.1
}

fn values<const D: usize>(tensor: Tensor<Oxi, D>) -> Vec<f32> {
    match tensor.try_into_data() {
        Ok(data) => data
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap_or_else(|e| panic!("{e:?}")),
        Err(e) => panic!("{e}"),
    }
}

/// Runs `f` on the CPU and on `xla:cpu:0` and compares.
fn check<const D: usize>(name: &str, tol: f32, f: impl Fn(&OxiDevice) -> Tensor<Oxi, D>) {
    let Some(xla) = common::xla_cpu(0) else {
        return;
    };
    let expected_tensor = f(&OxiDevice::Cpu);
    let shape = expected_tensor.dims();
    let expected = values(expected_tensor);
    let actual_tensor = f(&xla);
    assert_eq!(actual_tensor.dims(), shape, "{name}: shape");
    let actual = values(actual_tensor);
    let (error, worst) =
        oxidiff_test_support::relative_error_with_floor(name, &actual, &expected, 1e-12);
    assert!(
        error <= f64::from(tol),
        "{name}: relative error {error:e} > {tol:e}; {worst}\n  xla: {:?}\n  cpu: {:?}",
        &actual[..actual.len().min(8)],
        &expected[..expected.len().min(8)]
    );
}

const SHAPES: [[usize; 3]; 3] = [[1, 1, 7], [2, 3, 4], [4, 8, 33]];

#[test]
fn elementwise_binary_ops_match_cpu() {
    for (i, s) in SHAPES.into_iter().enumerate() {
        let seed = i as u64 * 10;
        check("add", F32_TOL, |d| {
            input(seed, s, d) + input(seed + 1, s, d)
        });
        check("sub", F32_TOL, |d| {
            input(seed, s, d) - input(seed + 1, s, d)
        });
        check("mul", F32_TOL, |d| {
            input(seed, s, d) * input(seed + 1, s, d)
        });
        check("div", F32_TOL, |d| {
            input(seed, s, d) / positive(seed + 1, s, d)
        });
        check("add broadcast", F32_TOL, |d| {
            input(seed, s, d) + input(seed + 1, [1, s[1], 1], d)
        });
        check("powf", F32_TOL, |d| {
            positive(seed, s, d).powf(input(seed + 1, s, d))
        });
        check("remainder", F32_TOL, |d| {
            input(seed, s, d).remainder(positive(seed + 1, s, d))
        });
    }
}

#[test]
fn scalar_ops_match_cpu_for_every_scalar_value() {
    for (i, s) in SHAPES.into_iter().enumerate() {
        let seed = 100 + i as u64;
        for k in [2.0f32, -0.5, 3.25] {
            check("add_scalar", F32_TOL, |d| input(seed, s, d) + k);
            check("sub_scalar", F32_TOL, |d| input(seed, s, d) - k);
            check("mul_scalar", F32_TOL, |d| input(seed, s, d) * k);
            check("div_scalar", F32_TOL, |d| input(seed, s, d) / k);
            check("powf_scalar", F32_TOL, |d| {
                positive(seed, s, d).powf_scalar(k)
            });
            check("clamp", F32_TOL, |d| {
                input(seed, s, d).clamp(-k.abs(), k.abs())
            });
        }
    }
}

#[test]
fn unary_float_ops_match_cpu() {
    for (i, s) in SHAPES.into_iter().enumerate() {
        let seed = 200 + i as u64;
        check("exp", F32_TOL, |d| input(seed, s, d).exp());
        check("log", F32_TOL, |d| positive(seed, s, d).log());
        check("log1p", F32_TOL, |d| positive(seed, s, d).log1p());
        check("sqrt", F32_TOL, |d| positive(seed, s, d).sqrt());
        check("sin", F32_TOL, |d| input(seed, s, d).sin());
        check("cos", F32_TOL, |d| input(seed, s, d).cos());
        check("tanh", F32_TOL, |d| input(seed, s, d).tanh());
        check("erf", F32_TOL, |d| input(seed, s, d).erf());
        check("neg", F32_TOL, |d| input(seed, s, d).neg());
        check("abs", F32_TOL, |d| input(seed, s, d).abs());
        check("recip", F32_TOL, |d| positive(seed, s, d).recip());
        check("floor", F32_TOL, |d| input(seed, s, d).floor());
        check("ceil", F32_TOL, |d| input(seed, s, d).ceil());
        check("round", F32_TOL, |d| (input(seed, s, d) * 3.0).round());
    }
}

#[test]
fn activations_match_cpu() {
    for (i, s) in SHAPES.into_iter().enumerate() {
        let seed = 300 + i as u64;
        check("gelu", F32_TOL, |d| gelu(input(seed, s, d)));
        check("silu", F32_TOL, |d| silu(input(seed, s, d)));
        check("sigmoid", F32_TOL, |d| sigmoid(input(seed, s, d)));
        check("relu", F32_TOL, |d| relu(input(seed, s, d)));
        check("softmax", F32_TOL, |d| softmax(input(seed, s, d), 2));
    }
}

#[test]
fn reductions_match_cpu() {
    for (i, s) in SHAPES.into_iter().enumerate() {
        let seed = 400 + i as u64;
        for dim in 0..3 {
            check("sum_dim", F32_TOL, |d| input(seed, s, d).sum_dim(dim));
            check("mean_dim", F32_TOL, |d| input(seed, s, d).mean_dim(dim));
            check("max_dim", F32_TOL, |d| input(seed, s, d).max_dim(dim));
            check("min_dim", F32_TOL, |d| input(seed, s, d).min_dim(dim));
            check("argmax", F32_TOL, |d| input(seed, s, d).argmax(dim).float());
        }
        check("cumsum", F32_TOL, |d| input(seed, s, d).cumsum(2));
        check("cumprod", F32_TOL, |d| input(seed, s, d).cumprod(1));
        check("cummax", F32_TOL, |d| input(seed, s, d).cummax(2));
        check("max_dim_with_indices", F32_TOL, |d| {
            let (values, indices) = input(seed, s, d).max_dim_with_indices(1);
            values + indices.float() * 10.0
        });
        check("sum", F32_TOL, |d| input(seed, s, d).sum());
        check("mean", F32_TOL, |d| input(seed, s, d).mean());
        check("max", F32_TOL, |d| input(seed, s, d).max());
        check("var", F32_TOL, |d| input(seed, s, d).var(2));
    }
}

#[test]
fn matmul_with_batch_dims_matches_cpu() {
    for (i, (m, k, n)) in [(1, 1, 1), (3, 5, 7), (16, 32, 8)].into_iter().enumerate() {
        let seed = 500 + i as u64;
        check("matmul 2d", F32_TOL, |d| {
            input(seed, [m, k], d).matmul(input(seed + 1, [k, n], d))
        });
        check("matmul 4d", F32_TOL, |d| {
            input(seed, [2, 3, m, k], d).matmul(input(seed + 1, [2, 3, k, n], d))
        });
        check("matmul broadcast batch", F32_TOL, |d| {
            input(seed, [2, 3, m, k], d).matmul(input(seed + 1, [1, 3, k, n], d))
        });
        check("linear", F32_TOL, |d| {
            linear(
                input(seed, [2, m, k], d),
                input(seed + 1, [k, n], d),
                Some(input(seed + 2, [n], d)),
            )
        });
    }
}

#[test]
fn shape_ops_match_cpu() {
    let s = [2, 3, 4];
    check("reshape", F32_TOL, |d| input(600, s, d).reshape([4, 6]));
    check("swap_dims", F32_TOL, |d| input(600, s, d).swap_dims(0, 2));
    check("permute", F32_TOL, |d| input(600, s, d).permute([1, 2, 0]));
    check("flip", F32_TOL, |d| input(600, s, d).flip([0, 2]));
    check("slice", F32_TOL, |d| {
        input(600, s, d).slice([0..2, 1..3, 0..4])
    });
    check("slice step", F32_TOL, |d| {
        input(600, [2, 3, 9], d).slice(burn::tensor::s![.., .., 1..9;2])
    });
    check("narrow", F32_TOL, |d| input(600, s, d).narrow(2, 1, 2));
    check("cat", F32_TOL, |d| {
        Tensor::cat(vec![input(600, s, d), input(601, [2, 5, 4], d)], 1)
    });
    check("repeat_dim", F32_TOL, |d| input(600, s, d).repeat_dim(1, 3));
    check("expand", F32_TOL, |d| {
        input(600, [1, 3, 1], d).expand([2, 3, 4])
    });
    check("pad", F32_TOL, |d| {
        input::<4>(600, [1, 2, 3, 4], d)
            .pad((1, 2, 0, 1), burn::tensor::ops::PadMode::Constant(0.5))
    });
    check("slice_assign", F32_TOL, |d| {
        input(600, s, d).slice_assign([0..1, 1..3, 2..4], input(601, [1, 2, 2], d))
    });
    check("zeros_like + ones", F32_TOL, |d| {
        input(600, s, d).zeros_like() + Tensor::ones(s, d)
    });
    check("full", F32_TOL, |d| Tensor::<Oxi, 3>::full(s, 0.75, d));
    check("arange", F32_TOL, |d| {
        Tensor::<Oxi, 1, Int>::arange(0..11, d).float()
    });
}

#[test]
fn indexing_ops_match_cpu() {
    let index_data = TensorData::new(vec![2i32, 0, 3, 3, 1], [5]);
    check("select", F32_TOL, |d| {
        let indices = Tensor::<Oxi, 1, Int>::from_data(index_data.clone(), d);
        input(700, [2, 4, 3], d).select(1, indices)
    });
    check("gather", F32_TOL, |d| {
        let indices =
            Tensor::<Oxi, 2, Int>::from_data(TensorData::new(vec![0i32, 2, 1, 1, 0, 0], [2, 3]), d);
        input(701, [2, 3], d).gather(1, indices)
    });
    check("embedding", F32_TOL, |d| {
        let ids =
            Tensor::<Oxi, 2, Int>::from_data(TensorData::new(vec![0i32, 5, 9, 2, 2, 7], [2, 3]), d);
        embedding(input(702, [10, 6], d), ids)
    });
    check("scatter add", F32_TOL, |d| {
        let indices =
            Tensor::<Oxi, 2, Int>::from_data(TensorData::new(vec![0i32, 2, 2, 1, 0, 0], [2, 3]), d);
        input(709, [2, 4], d).scatter(1, indices, input(710, [2, 3], d), IndexingUpdateOp::Add)
    });
    check("select_assign add", F32_TOL, |d| {
        let indices = Tensor::<Oxi, 1, Int>::from_data(index_data.clone(), d);
        input(711, [2, 4, 3], d).select_assign(
            1,
            indices,
            input(712, [2, 5, 3], d),
            IndexingUpdateOp::Add,
        )
    });
    check("mask_where", F32_TOL, |d| {
        let mask: Tensor<Oxi, 3, Bool> = input(703, [2, 3, 4], d).greater_elem(0.0);
        input(704, [2, 3, 4], d).mask_where(mask, input(705, [2, 3, 4], d))
    });
    check("mask_fill", F32_TOL, |d| {
        let mask = input(703, [2, 3, 4], d).lower(input(706, [2, 3, 4], d));
        input(704, [2, 3, 4], d).mask_fill(mask, -1.5)
    });
    check("comparisons", F32_TOL, |d| {
        let a = input(707, [3, 4], d);
        let b = input(708, [3, 4], d);
        a.clone().greater_equal(b.clone()).float()
            + a.clone().lower_equal_elem(0.25).float() * 2.0
            + a.equal(b).float() * 4.0
    });
}

#[test]
fn conv2d_matches_cpu() {
    for (i, (stride, padding, groups, dilation)) in [
        (1, 1, 1, 1),
        (2, 1, 1, 1),
        (1, 0, 2, 1),
        (1, 2, 1, 2),
        (2, 0, 4, 1),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 800 + i as u64;
        check("conv2d", F32_TOL, |d| {
            conv2d(
                input(seed, [2, 4, 9, 8], d),
                input(seed + 1, [8, 4 / groups, 3, 3], d),
                Some(input(seed + 2, [8], d)),
                ConvOptions::new(
                    [stride, stride],
                    [padding, padding],
                    [dilation, dilation],
                    groups,
                ),
            )
        });
    }
}

#[test]
fn conv_transpose2d_matches_cpu() {
    use burn::tensor::module::conv_transpose2d;
    use burn::tensor::ops::ConvTransposeOptions;
    for (i, (stride, padding, padding_out, groups, dilation)) in [
        (1, 0, 0, 1, 1),
        (2, 1, 1, 1, 1),
        (2, 0, 0, 2, 1),
        (1, 1, 0, 1, 2),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 850 + i as u64;
        check("conv_transpose2d", F32_TOL, |d| {
            conv_transpose2d(
                input(seed, [2, 4, 5, 6], d),
                input(seed + 1, [4, 6 / groups, 3, 3], d),
                Some(input(seed + 2, [6], d)),
                ConvTransposeOptions::new(
                    [stride, stride],
                    [padding, padding],
                    [padding_out, padding_out],
                    [dilation, dilation],
                    groups,
                ),
            )
        });
    }
}

#[test]
fn interpolate_bilinear_matches_cpu() {
    for align_corners in [false, true] {
        let options =
            || InterpolateOptions::new(InterpolateMode::Bilinear).with_align_corners(align_corners);
        check("bilinear up", F32_TOL, |d| {
            interpolate(input(950, [1, 2, 3, 5], d), [7, 9], options())
        });
        check("bilinear down", F32_TOL, |d| {
            interpolate(input(951, [2, 3, 8, 6], d), [3, 4], options())
        });
    }
}

#[test]
fn interpolate_nearest_matches_cpu() {
    let nearest = || InterpolateOptions::new(InterpolateMode::Nearest);
    check("nearest 2x", F32_TOL, |d| {
        interpolate(input(900, [1, 2, 3, 5], d), [6, 10], nearest())
    });
    check("nearest to size", F32_TOL, |d| {
        interpolate(input(901, [2, 3, 7, 5], d), [4, 9], nearest())
    });
}

#[test]
fn attention_matches_cpu() {
    for (i, causal) in [false, true].into_iter().enumerate() {
        let seed = 1000 + 10 * i as u64;
        let options = AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        };
        check("attention", F32_TOL, |d| {
            attention(
                input(seed, [2, 3, 5, 8], d),
                input(seed + 1, [2, 3, 7, 8], d),
                input(seed + 2, [2, 3, 7, 4], d),
                None,
                None,
                options,
            )
        });
        check("attention mask bias scale", F32_TOL, |d| {
            let mask = input(seed + 3, [2, 3, 5, 7], d).greater_elem(1.0);
            attention(
                input(seed, [2, 3, 5, 8], d),
                input(seed + 1, [2, 3, 7, 8], d),
                input(seed + 2, [2, 3, 7, 4], d),
                Some(mask),
                Some(input(seed + 4, [2, 3, 5, 7], d)),
                AttentionModuleOptions {
                    scale: Some(0.3),
                    ..options
                },
            )
        });
    }
}

#[test]
fn bf16_ops_match_cpu() {
    let s = [2, 3, 16];
    let bf = |t: Tensor<Oxi, 3>| t.cast(DType::BF16);
    check("bf16 add", BF16_TOL, |d| {
        bf(input(1100, s, d)) + bf(input(1101, s, d))
    });
    check("bf16 mul_scalar", BF16_TOL, |d| bf(input(1100, s, d)) * 1.5);
    check("bf16 exp", BF16_TOL, |d| bf(input(1100, s, d)).exp());
    check("bf16 gelu", BF16_TOL, |d| gelu(bf(input(1100, s, d))));
    check("bf16 sum_dim", BF16_TOL, |d| {
        bf(input(1100, s, d)).sum_dim(2)
    });
    check("bf16 matmul", BF16_TOL, |d| {
        bf(input(1100, s, d)).matmul(bf(input(1101, [2, 16, 5], d)))
    });
    check("bf16 softmax", BF16_TOL, |d| {
        softmax(bf(input(1100, s, d)), 2)
    });
    check("f16 add", BF16_TOL, |d| {
        input(1100, s, d).cast(DType::F16) + input(1101, s, d).cast(DType::F16)
    });
}

#[test]
fn random_tensors_have_the_asked_distribution() {
    let Some(xla) = common::xla_cpu(0) else {
        return;
    };
    let n = 20_000;
    let u = values(Tensor::<Oxi, 1>::random([n], Distribution::Default, &xla));
    assert!(u.iter().all(|v| (0.0..1.0).contains(v)));
    let mean = u.iter().sum::<f32>() / n as f32;
    assert!((mean - 0.5).abs() < 0.02, "uniform mean {mean}");
    let z = values(Tensor::<Oxi, 1>::random(
        [n],
        Distribution::Normal(1.0, 2.0),
        &xla,
    ));
    let mean = z.iter().sum::<f32>() / n as f32;
    let var = z.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n as f32;
    assert!((mean - 1.0).abs() < 0.1, "normal mean {mean}");
    assert!((var.sqrt() - 2.0).abs() < 0.1, "normal std {}", var.sqrt());
    // Seeding makes draws repeat.
    <Oxi as burn::tensor::backend::Backend>::seed(&xla, 42);
    let first = values(Tensor::<Oxi, 1>::random([8], Distribution::Default, &xla));
    <Oxi as burn::tensor::backend::Backend>::seed(&xla, 42);
    let again = values(Tensor::<Oxi, 1>::random([8], Distribution::Default, &xla));
    assert_eq!(first, again);
    // Two draws differ.
    let a = values(Tensor::<Oxi, 1>::random([8], Distribution::Default, &xla));
    let b = values(Tensor::<Oxi, 1>::random([8], Distribution::Default, &xla));
    assert_ne!(a, b);
}

#[test]
fn pools_match_cpu() {
    use burn::tensor::module::{avg_pool2d, max_pool2d};
    for (i, (kernel, stride, padding)) in [(2, 2, 0), (3, 1, 1), (3, 2, 1)].into_iter().enumerate()
    {
        let seed = 1200 + i as u64;
        check("max_pool2d", F32_TOL, |d| {
            max_pool2d(
                input(seed, [2, 3, 8, 7], d),
                [kernel, kernel],
                [stride, stride],
                [padding, padding],
                [1, 1],
                false,
            )
        });
        for count_include_pad in [true, false] {
            check("avg_pool2d", F32_TOL, |d| {
                avg_pool2d(
                    input(seed, [2, 3, 8, 7], d),
                    [kernel, kernel],
                    [stride, stride],
                    [padding, padding],
                    count_include_pad,
                    false,
                )
            });
        }
    }
}

#[test]
fn int_and_bool_ops_match_cpu() {
    let ints =
        |seed: u64, d: &OxiDevice| -> Tensor<Oxi, 2, Int> { (input(seed, [3, 5], d) * 10.0).int() };
    check("int add mul", F32_TOL, |d| {
        (ints(1300, d) + ints(1301, d) * 3).float()
    });
    check("int div rem", F32_TOL, |d| {
        let b = ints(1301, d).abs() + 1;
        (ints(1300, d).abs().div(b.clone()) + ints(1300, d).abs().remainder(b) * 100).float()
    });
    check("int matmul", F32_TOL, |d| {
        ints(1300, d).matmul(ints(1301, d).transpose()).float()
    });
    check("int sum_dim argmin", F32_TOL, |d| {
        ints(1300, d).sum_dim(1).float() + input(1302, [3, 5], d).argmin(1).float()
    });
    check("trunc", F32_TOL, |d| (input(1303, [3, 5], d) * 3.0).trunc());
    check("bool not and or", F32_TOL, |d| {
        let a = input(1304, [3, 5], d).greater_elem(0.0);
        let b = input(1305, [3, 5], d).lower_elem(0.5);
        a.clone().bool_not().float()
            + a.clone().bool_and(b.clone()).float() * 2.0
            + a.bool_or(b).float() * 4.0
    });
}

/// The ops the PixArt/T5 path adds: tanh GELU (`x^3` of negative inputs), and attention with a
/// padding-mask bias broadcast from `[batch, 1, 1, seq]` holding T5's `f32::MIN` and PixArt's
/// `-10000`, added to a per-head position bias.
#[test]
fn pixart_t5_ops_match_cpu() {
    check("gelu_approximate", F32_TOL, |d| {
        burn::tensor::activation::gelu_approximate(input(1200, [2, 3, 16], d).mul_scalar(3.0))
    });
    check("powf_scalar 3 of negative values", F32_TOL, |d| {
        input(1201, [4, 16], d).powf_scalar(3.0)
    });
    for (i, masked) in [f32::MIN, -10000.0].into_iter().enumerate() {
        let seed = 1210 + 10 * i as u64;
        check("attention padding-mask bias", F32_TOL, |d| {
            // Batch row 0 keeps 5 of 7 keys, row 1 keeps 2.
            let keep = [5usize, 2];
            let mask: Vec<f32> = keep
                .iter()
                .flat_map(|&k| (0..7).map(move |j| if j < k { 0.0 } else { masked }))
                .collect();
            let mask = Tensor::<Oxi, 2>::from_data(TensorData::new(mask, [2, 7]), d)
                .reshape([2, 1, 1, 7])
                .expand([2, 3, 5, 7]);
            let position = input(seed + 3, [1, 3, 5, 7], d).expand([2, 3, 5, 7]);
            attention(
                input(seed, [2, 3, 5, 8], d),
                input(seed + 1, [2, 3, 7, 8], d),
                input(seed + 2, [2, 3, 7, 4], d),
                None,
                Some(position + mask),
                AttentionModuleOptions {
                    scale: Some(1.0),
                    ..Default::default()
                },
            )
        });
    }
}
