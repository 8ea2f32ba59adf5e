//! Compiled mode on the XLA CPU plugin: closures traced into one StableHLO
//! program, compiled once per input signature, against the same closures in
//! eager mode (and the tiny UNet against the CPU device).

mod common;

use std::path::PathBuf;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Distribution, Tensor, TensorData};
use oxidiff_backend_tpu::compiled::{compile_count, CompileError, CompiledFn};
use oxidiff_backend_tpu::{Oxi, OxiDevice};
use oxidiff_models::{UNet2DConditionModel, Weights};
use rand::{Rng, SeedableRng};

fn random<const D: usize>(
    rng: &mut rand::rngs::StdRng,
    shape: [usize; D],
    device: &OxiDevice,
) -> Tensor<Oxi, D> {
    let count = shape.iter().product();
    let values: Vec<f32> = (0..count).map(|_| rng.random_range(-1.0..1.0)).collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// Held by the tests on `xla:cpu:0` for reading (any number at once) and by the one that makes
/// ops fail there on purpose for writing: a device reports its first error at the next read,
/// whichever test makes it.
static DEVICE0: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn reads_on_device0() -> std::sync::RwLockReadGuard<'static, ()> {
    DEVICE0
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn values<const D: usize>(tensor: Tensor<Oxi, D>) -> (Vec<usize>, Vec<f32>) {
    let dims = tensor.dims().to_vec();
    let data = tensor
        .try_into_data()
        .unwrap_or_else(|e| panic!("reading a result: {e}"));
    (dims, data.convert::<f32>().to_vec::<f32>().unwrap())
}

/// Largest absolute difference over the largest magnitude of `expected`; NaN or infinity on
/// either side fails (see [`oxidiff_test_support`]).
fn relative_error<const D: usize>(actual: Tensor<Oxi, D>, expected: Tensor<Oxi, D>) -> f32 {
    let (actual_dims, actual) = values(actual);
    let (expected_dims, expected) = values(expected);
    assert_eq!(actual_dims, expected_dims, "shape");
    oxidiff_test_support::relative_error("compiled output", &actual, &expected) as f32
}

struct Mlp {
    w1: Tensor<Oxi, 2>,
    b1: Tensor<Oxi, 1>,
    w2: Tensor<Oxi, 2>,
}

impl Mlp {
    fn new(device: &OxiDevice) -> Self {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        Self {
            w1: random(&mut rng, [8, 16], device),
            b1: random(&mut rng, [16], device),
            w2: random(&mut rng, [16, 4], device),
        }
    }

    /// `scale` is a `[1]` tensor: a value that changes between calls.
    fn forward(&self, x: Tensor<Oxi, 2>, scale: Tensor<Oxi, 1>) -> Tensor<Oxi, 2> {
        let h = (x.matmul(self.w1.clone()) + self.b1.clone().unsqueeze()).tanh();
        let h = burn::tensor::activation::gelu(h * 0.5 + 0.25);
        h.matmul(self.w2.clone()) * scale.unsqueeze()
    }
}

/// Same math in f32, one program against op-by-op executables: XLA may fuse
/// and reorder within 1e-5 relative.
const MLP_TOL: f32 = 1e-5;

#[test]
fn mlp_compiled_once_matches_eager_and_recompiles_only_for_new_shapes() {
    let _reads = reads_on_device0();
    let Some(device) = common::xla_cpu(0) else {
        return;
    };
    let mlp = Mlp::new(&device);
    let step = CompiledFn::new("mlp", |(x, scale): (Tensor<Oxi, 2>, Tensor<Oxi, 1>)| {
        mlp.forward(x, scale)
    });
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let scale = |v: f32| Tensor::<Oxi, 1>::from_floats([v], &device);

    let x = random(&mut rng, [3, 8], &device);
    let compiled = step.call((x.clone(), scale(1.5))).unwrap();
    let eager = mlp.forward(x, scale(1.5));
    let error = relative_error(compiled, eager);
    eprintln!("mlp first call: relative error {error:e}");
    assert!(error <= MLP_TOL, "first call: {error:e}");
    assert_eq!(step.compiles(), 1);
    let info = &step.compile_log()[0];
    eprintln!("mlp compile: {info}");
    assert_eq!(info.inputs, 2);
    assert_eq!(info.captured, 3, "w1, b1, w2 are runtime arguments");
    assert!(info.scalars >= 2, "0.5 and 0.25 are runtime arguments");

    // New values, same shapes: the cached program.
    for v in [-2.0, 0.25] {
        let x = random(&mut rng, [3, 8], &device);
        let compiled = step.call((x.clone(), scale(v))).unwrap();
        let error = relative_error(compiled, mlp.forward(x, scale(v)));
        assert!(error <= MLP_TOL, "cached call, scale {v}: {error:e}");
    }
    assert_eq!(step.compiles(), 1, "new values must not recompile");

    // A new batch size compiles once more, and then is cached too.
    for _ in 0..2 {
        let x = random(&mut rng, [5, 8], &device);
        let compiled = step.call((x.clone(), scale(3.0))).unwrap();
        let error = relative_error(compiled, mlp.forward(x, scale(3.0)));
        assert!(error <= MLP_TOL, "batch 5: {error:e}");
    }
    assert_eq!(step.compiles(), 2);
    assert!(step.compile_log()[1].reason.contains("new input signature"));
    assert!(compile_count() >= 2);
}

#[test]
fn constants_made_inside_the_closure_survive_cached_calls() {
    let _reads = reads_on_device0();
    let Some(device) = common::xla_cpu(0) else {
        return;
    };
    let f = CompiledFn::new("offset", |x: Tensor<Oxi, 1>| {
        let offset = Tensor::<Oxi, 1>::from_floats([1.0, 2.0, 3.0], &x.device());
        x + offset
    });
    for base in [0.0f32, 10.0, 20.0] {
        let x = Tensor::<Oxi, 1>::from_floats([base; 3], &device);
        let (_, y) = values(f.call(x).unwrap());
        assert_eq!(y, vec![base + 1.0, base + 2.0, base + 3.0]);
    }
    assert_eq!(f.compiles(), 1);
}

#[test]
fn several_outputs_and_random_draws_per_call() {
    let _reads = reads_on_device0();
    let Some(device) = common::xla_cpu(0) else {
        return;
    };
    let f = CompiledFn::new("noise", |x: Tensor<Oxi, 2>| {
        let noise =
            Tensor::<Oxi, 2>::random(x.shape(), Distribution::Normal(0.0, 1.0), &x.device());
        (x.clone() + noise.clone(), noise, x.sum())
    });
    let x = || Tensor::<Oxi, 2>::ones([4, 64], &device);
    let (a, noise_a, sum) = f.call(x()).unwrap();
    let (b, noise_b, _) = f.call(x()).unwrap();
    assert_eq!(f.compiles(), 1);
    assert_eq!(values(sum).1, vec![256.0]);
    let (_, noise_a) = values(noise_a);
    let (_, noise_b) = values(noise_b);
    assert_ne!(noise_a, noise_b, "each call draws a fresh random state");
    let error = relative_error(
        a - 1.0,
        Tensor::from_data(TensorData::new(noise_a, [4, 64]), &device),
    );
    assert!(error <= 1e-6);
    drop(b);
}

#[test]
fn reading_a_value_while_tracing_fails() {
    let _reads = reads_on_device0();
    let Some(device) = common::xla_cpu(0) else {
        return;
    };
    let f = CompiledFn::new("reads", |x: Tensor<Oxi, 1>| {
        let read = x.clone().try_into_data();
        assert!(read.is_err(), "a read while tracing must fail");
        x * 2.0
    });
    let (_, y) = values(f.call(Tensor::from_floats([1.0, 2.0], &device)).unwrap());
    assert_eq!(y, vec![2.0, 4.0]);
}

#[test]
fn inputs_on_the_cpu_are_rejected() {
    let f = CompiledFn::new("cpu", |x: Tensor<Oxi, 1>| x * 2.0);
    let Err(error) = f.call(Tensor::from_floats([1.0], &OxiDevice::Cpu)) else {
        panic!("a cpu input must fail");
    };
    assert!(matches!(error, CompileError::Placement { .. }), "{error}");
    assert!(error.to_string().contains("to_device"), "{error}");
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn golden_tensor<const D: usize>(
    golden: &Weights,
    key: &str,
    device: &OxiDevice,
) -> Tensor<Oxi, D> {
    let (values, shape) = golden
        .read_f32(key)
        .unwrap_or_else(|e| panic!("golden key {key}: {e}"));
    let shape: [usize; D] = shape
        .try_into()
        .unwrap_or_else(|s| panic!("{key}: rank of {s:?}"));
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// XLA and burn-flex sum convolutions, matmuls and reductions in different
/// orders, and the compiled program fuses further: 1e-4 relative, as the
/// eager model tests.
const UNET_TOL: f32 = 1e-4;

#[test]
fn tiny_unet_compiled_as_one_program_matches_cpu_and_reuses_it_for_new_timesteps() {
    let _reads = reads_on_device0();
    let Some(xla) = common::xla_cpu(0) else {
        return;
    };
    let golden = Weights::from_files(&[fixtures().join("golden/tiny-sd1.safetensors")])
        .unwrap_or_else(|e| panic!("golden tensors: {e}"));
    let unet = UNet2DConditionModel::<Oxi>::from_dir(
        &fixtures().join("tiny-sd1/unet"),
        None,
        &OxiDevice::Cpu,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let inputs = |t: f32, device: &OxiDevice| {
        (
            golden_tensor::<4>(&golden, "unet.sample", device),
            Tensor::<Oxi, 1>::from_floats([t], device),
            golden_tensor::<3>(&golden, "unet.encoder_hidden_states", device),
        )
    };
    let cpu = |t: f32| {
        let (x, t, c) = inputs(t, &OxiDevice::Cpu);
        unet.forward(x, t, c)
    };
    let (expected_500, expected_200) = (cpu(500.0), cpu(200.0));

    let unet = unet.to_device(&xla);
    let timed = |f: &dyn Fn() -> Tensor<Oxi, 4>| {
        let start = Instant::now();
        let out = f();
        let data = out.clone().into_data();
        drop(data);
        (out, start.elapsed())
    };
    let eager = |t: f32| {
        let (x, t, c) = inputs(t, &xla);
        unet.forward(x, t, c)
    };
    let (_, eager_first) = timed(&|| eager(500.0));
    let (_, eager_cached) = timed(&|| eager(500.0));

    let step = CompiledFn::new("unet", |(x, t, c)| unet.forward(x, t, c));
    let (first, compiled_first) = timed(&|| step.call(inputs(500.0, &xla)).unwrap());
    let (second, compiled_cached) = timed(&|| step.call(inputs(200.0, &xla)).unwrap());
    let (_, compiled_cached_again) = timed(&|| step.call(inputs(200.0, &xla)).unwrap());
    let info = step.compile_log()[0].clone();
    eprintln!("unet compile: {info}");
    eprintln!(
        "tiny unet forward on xla:cpu: eager first {eager_first:.1?}, eager cached {eager_cached:.1?}; compiled first (trace+lower+compile+run) {compiled_first:.1?}, compiled cached {compiled_cached:.1?} and {compiled_cached_again:.1?}"
    );
    let error_500 = relative_error(first, expected_500);
    let error_200 = relative_error(second, expected_200);
    eprintln!("unet compiled vs cpu: relative error t=500 {error_500:e}, t=200 {error_200:e}; compiles {}", step.compiles());
    assert!(error_500 <= UNET_TOL, "t=500: {error_500:e}");
    assert!(error_200 <= UNET_TOL, "t=200: {error_200:e}");
    assert_eq!(
        step.compiles(),
        1,
        "a new timestep value must not recompile"
    );
    assert!(info.captured > 50, "the weights are runtime arguments");
}

/// The eager client's live buffers on `device`.
fn live_buffers(device: &OxiDevice) -> usize {
    match burn_router::get_client::<oxidiff_backend_tpu::OxiChannel>(device) {
        oxidiff_backend_tpu::OxiClient::Pjrt(client) => client.stats().buffers,
        oxidiff_backend_tpu::OxiClient::Cpu(_) => 0,
    }
}

#[test]
fn donated_latents_are_replaced_in_place_and_shared_inputs_are_copied() {
    // Its own device, so other tests' buffers do not change the count.
    let Some(device) = common::xla_cpu(1) else {
        return;
    };
    let step = CompiledFn::new("euler", |(x, d): (Tensor<Oxi, 2>, Tensor<Oxi, 2>)| {
        x + d * 0.5
    })
    .donate(0, 0);
    let d = Tensor::<Oxi, 2>::ones([16, 16], &device);
    let mut x = Tensor::<Oxi, 2>::zeros([16, 16], &device);
    // First call traces; then the loop reaches a steady state of buffers.
    x = step.call((x, d.clone())).unwrap();
    let before = live_buffers(&device);
    for _ in 0..4 {
        x = step.call((x, d.clone())).unwrap();
    }
    assert_eq!(live_buffers(&device), before, "no buffer leaks per step");
    assert_eq!(step.compiles(), 1);
    assert_eq!(step.compile_log()[0].donated, 1);
    assert_eq!(values(x.clone()).1, vec![2.5; 256]);

    // An input still referenced elsewhere keeps its values (it is copied).
    let kept = x.clone();
    let y = step.call((x, d.clone())).unwrap();
    assert_eq!(values(kept).1, vec![2.5; 256]);
    assert_eq!(values(y).1, vec![3.0; 256]);

    // A donation whose shapes differ is refused with a message.
    let bad = CompiledFn::new("sum", |x: Tensor<Oxi, 2>| x.sum_dim(0)).donate(0, 0);
    let Err(error) = bad.call(Tensor::<Oxi, 2>::ones([4, 4], &device)) else {
        panic!("a donation between different shapes must fail");
    };
    assert!(matches!(error, CompileError::Donation { .. }), "{error}");
}

#[test]
fn a_second_compiled_function_and_a_warm_start_load_the_executable_from_the_disk_cache() {
    let _reads = reads_on_device0();
    let Some(device) = common::xla_cpu(0) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let w = Tensor::<Oxi, 2>::from_floats([[1.0, 2.0], [3.0, 4.0]], &device);
    let f = |x: Tensor<Oxi, 2>| (x.matmul(w.clone()) * 3.0).exp();
    let x = || Tensor::<Oxi, 2>::from_floats([[0.1, 0.2], [0.3, -0.4]], &device);

    let first = CompiledFn::new("disk", f).with_disk_cache(&dir);
    let a = first.call(x()).unwrap();
    assert!(!first.compile_log()[0].from_disk);
    let files = std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
    assert_eq!(files, 1, "one serialized executable in {}", dir.display());

    let second = CompiledFn::new("disk", f).with_disk_cache(&dir);
    let b = second.call(x()).unwrap();
    let info = &second.compile_log()[0];
    eprintln!("disk cache: {info}");
    assert!(info.from_disk, "{info}");
    assert_eq!(values(a).1, values(b).1);

    // Warm start: a function warm-started under a tag loads, before its first call, the
    // programs built under that tag earlier, and its first call runs one of them; another tag
    // loads nothing (its call still finds the executable on disk), and a damaged entry is
    // skipped at warm start and rebuilt with a warning when the call needs it.
    let wide = || Tensor::<Oxi, 2>::ones([3, 2], &device);
    let warm = |tag: &str| {
        CompiledFn::new("disk", f)
            .with_disk_cache(&dir)
            .warm_start(tag, &device)
    };

    // Nothing listed yet: the first function lists both signatures (one compiled).
    let lister = warm("model a");
    let expected = values(lister.call(x()).unwrap()).1;
    lister.call(wide()).unwrap();
    assert_eq!(lister.xla_compiles(), 1);
    assert!(lister.compile_log().iter().all(|i| !i.warm_start));

    let warmed = warm("model a");
    let y = warmed.call(x()).unwrap();
    let info = &warmed.compile_log()[0];
    assert!(info.warm_start && info.from_disk, "{info}");
    assert!(info.to_string().contains("at warm start"), "{info}");
    assert_eq!(values(y).1, expected);
    assert_eq!(warmed.xla_compiles(), 0);

    // Another tag: nothing loaded ahead, the executable still comes from the disk.
    let other = warm("model b");
    other.call(x()).unwrap();
    let info = &other.compile_log()[0];
    assert!(!info.warm_start && info.from_disk, "{info}");

    // A flipped byte in every entry: skipped at warm start, rebuilt at the call.
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "pjrt") {
            let mut bytes = std::fs::read(&path).unwrap();
            let middle = bytes.len() / 2;
            bytes[middle] ^= 0x5a;
            std::fs::write(&path, bytes).unwrap();
        }
    }
    let damaged = warm("model a");
    let y = damaged.call(x()).unwrap();
    let info = &damaged.compile_log()[0];
    assert!(!info.warm_start && !info.from_disk, "{info}");
    assert!(info.rejected_cache_entry.is_some(), "{info}");
    assert_eq!(values(y).1, expected);

    // An unreadable warm list (a folder in its place) only costs the warm start.
    let lists = dir.join("warm");
    std::fs::remove_dir_all(&lists).unwrap();
    std::fs::write(&lists, b"not a folder").unwrap();
    let unlisted = warm("model a");
    let y = unlisted.call(x()).unwrap();
    assert!(!unlisted.compile_log()[0].warm_start);
    assert_eq!(values(y).1, expected);
}

/// The plugin honours `tf.aliasing_output`: the donated argument is gone
/// after the run (compiled mode relies on this to drop its buffer).
#[test]
fn the_plugin_consumes_a_donated_argument() {
    use oxidiff_backend_tpu::pjrt::{CompileOptions, ElementType, Shape};
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = plugin.client().unwrap();
    let device = client.device(0).unwrap();
    let module = r#"module @donate attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%a: tensor<4xf32> {tf.aliasing_output = 0 : i32}, %b: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.add %a, %b : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"#;
    let exe = client
        .compile(module, &CompileOptions::on_device(i64::from(device.id())))
        .unwrap();
    let shape = Shape::new(ElementType::F32, vec![4]);
    let bytes = |v: f32| {
        [v; 4]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let a = client
        .buffer_from_host(&bytes(1.0), &shape, &device)
        .unwrap();
    let b = client
        .buffer_from_host(&bytes(2.0), &shape, &device)
        .unwrap();
    let out = exe.execute(&[&a, &b]).unwrap();
    assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![3.0; 4]);
    assert!(a.to_host().is_err(), "the donated buffer is consumed");
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![2.0; 4]);
}

#[test]
fn a_compiled_function_called_inside_another_is_inlined() {
    let _reads = reads_on_device0();
    let Some(device) = common::xla_cpu(0) else {
        return;
    };
    let inner = CompiledFn::new("inner", |x: Tensor<Oxi, 1>| x.exp());
    let outer = CompiledFn::new("outer", |x: Tensor<Oxi, 1>| {
        inner.call(x * 2.0).unwrap() + 1.0
    });
    for _ in 0..2 {
        let (_, y) = values(
            outer
                .call(Tensor::from_floats([0.0, 0.5], &device))
                .unwrap(),
        );
        let expected = [2.0f32, 1.0f32.exp() + 1.0];
        assert!(
            y.iter().zip(expected).all(|(a, e)| (a - e).abs() <= 1e-6),
            "{y:?}"
        );
    }
    assert_eq!(outer.compiles(), 1);
    assert_eq!(inner.compiles(), 0, "inlined into the outer program");
    assert_eq!(outer.compile_log()[0].ops, 3);
}

/// Captured convolution kernels go into compiled programs permuted once
/// (spatial dimensions first, `Lowerer::with_kernels_last`): results equal
/// eager mode's (Burn's layout) for strided, dilated, padded 2-D and 1-D
/// convolutions, a kernel that is also read elsewhere in the program, one
/// made inside the closure and one passed as an input, on the first call and
/// on cached calls with new values.
#[test]
fn captured_convolution_kernels_are_permuted_once_and_match_eager() {
    use burn::tensor::module::{conv1d, conv2d};
    use burn::tensor::ops::ConvOptions;
    let _reads = reads_on_device0();
    let Some(device) = common::xla_cpu(0) else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let w2 = random(&mut rng, [6, 4, 3, 3], &device);
    let b2 = random(&mut rng, [6], &device);
    let w1 = random(&mut rng, [5, 6, 3], &device);
    let forward = |x: Tensor<Oxi, 4>, w_in: Tensor<Oxi, 4>| {
        let y = conv2d(
            x.clone(),
            w2.clone(),
            Some(b2.clone()),
            ConvOptions::new([2, 1], [1, 2], [1, 2], 1),
        );
        // The same kernel read as a plain tensor too.
        let y = y + w2.clone().sum().reshape([1, 1, 1, 1]);
        let [b, c, h, w] = y.dims();
        let z = conv1d(
            y.reshape([b, c, h * w]),
            w1.clone(),
            None,
            ConvOptions::new([1], [1], [1], 1),
        );
        // A kernel made inside the closure, and one that is an input.
        let made = (0..12).map(|i| i as f32 / 8.0 - 0.7).collect::<Vec<_>>();
        let made = Tensor::<Oxi, 4>::from_data(TensorData::new(made, [3, 4, 1, 1]), &x.device());
        let m = conv2d(
            x.clone(),
            made,
            None,
            ConvOptions::new([1, 1], [0, 0], [1, 1], 1),
        );
        let n = conv2d(x, w_in, None, ConvOptions::new([1, 1], [1, 1], [1, 1], 1));
        (z, m + n)
    };
    let step = CompiledFn::new("convs", |(x, w_in): (Tensor<Oxi, 4>, Tensor<Oxi, 4>)| {
        forward(x, w_in)
    });
    for call in 0..3 {
        let x = random(&mut rng, [2, 4, 7, 9], &device);
        let w_in = random(&mut rng, [3, 4, 3, 3], &device);
        let (z, mn) = step.call((x.clone(), w_in.clone())).unwrap();
        let (ez, emn) = forward(x, w_in);
        let (ze, mne) = (relative_error(z, ez), relative_error(mn, emn));
        eprintln!("convs call {call}: relative errors {ze:e}, {mne:e}");
        assert!(
            ze <= MLP_TOL && mne <= MLP_TOL,
            "call {call}: {ze:e}, {mne:e}"
        );
    }
    assert_eq!(step.compiles(), 1);
}

/// One update of a multistep scheduler: `x * a + d` on the first call, then
/// `x * a + 1.5 d - 0.5 d_prev`, with `d = eps * b` kept as history; `a` and `b` change with
/// the step `k`.
fn multistep_update(
    history: &mut Vec<Tensor<Oxi, 4>>,
    x: Tensor<Oxi, 4>,
    eps: Tensor<Oxi, 4>,
    k: usize,
) -> Tensor<Oxi, 4> {
    let (a, b) = (1.0 - 0.1 * k as f64, 0.05 * (k + 1) as f64);
    let d = eps * b;
    let out = match history.last() {
        Some(prev) => x * a + d.clone() * 1.5 - prev.clone() * 0.5,
        None => x * a + d.clone(),
    };
    history.push(d);
    out
}

/// A fused call records its code's ops on every call and runs them as one program: new
/// scalars reuse it (they are arguments), a tensor the code keeps (the history) gets its value
/// as an output, a new structure builds exactly one more program, the results equal the same
/// code run op by op, and another `Fused` with the same disk cache loads the programs
/// instead of compiling them.
#[test]
fn fused_calls_take_scalars_as_arguments_keep_their_state_and_share_the_disk_cache() {
    use oxidiff_backend_tpu::compiled::{Fused, FusedStats};
    let _reads = reads_on_device0();
    let Some(device) = common::xla_cpu(0) else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let x0 = random(&mut rng, [2, 3, 4, 5], &device);
    let eps = random(&mut rng, [2, 3, 4, 5], &device);
    let run = |fused: Option<&Fused>| -> (Vec<f32>, Vec<Vec<f32>>) {
        let mut history = Vec::new();
        let mut x = x0.clone();
        for k in 0..4 {
            let e = eps.clone();
            x = match fused {
                Some(fused) => fused
                    .run(&device, || multistep_update(&mut history, x, e, k))
                    .unwrap_or_else(|e| panic!("{e}")),
                None => multistep_update(&mut history, x, e, k),
            };
        }
        let kept = history.into_iter().map(|h| values(h).1).collect();
        (values(x).1, kept)
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let (eager, eager_history) = run(None);

    let first = Fused::new("multistep").with_disk_cache(&dir);
    let (fused, fused_history) = run(Some(&first));
    assert_eq!(
        first.stats(),
        FusedStats {
            calls: 4,
            programs: 2,
            xla_compiles: 2,
            disk_loads: 0,
            eager_fallbacks: 0
        },
        "one program for the first step, one for the steps with history"
    );
    let close = |what: &str, a: &[f32], b: &[f32]| {
        let err = oxidiff_test_support::relative_error(what, a, b);
        assert!(err <= 1e-6, "{what}: relative error {err:e}");
    };
    close("fused vs eager result", &fused, &eager);
    assert_eq!(fused_history.len(), 4);
    for (a, b) in fused_history.iter().zip(&eager_history) {
        close("kept history", a, b);
    }

    let second = Fused::new("multistep").with_disk_cache(&dir);
    let (again, _) = run(Some(&second));
    let stats = second.stats();
    assert_eq!(
        (stats.programs, stats.xla_compiles, stats.disk_loads),
        (2, 0, 2)
    );
    assert_eq!(again, fused);
}

/// A fused call whose ops cannot all be lowered runs them one by one instead, as eager mode
/// would: the same error when the value is read, never a panic.
#[test]
fn a_fused_call_that_cannot_be_lowered_runs_op_by_op() {
    use burn::tensor::Int;
    use oxidiff_backend_tpu::compiled::Fused;
    let _alone = DEVICE0
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(device) = common::xla_cpu(0) else {
        return;
    };
    let fused = Fused::new("fallback");
    let x = Tensor::<Oxi, 1>::from_floats([1.0, 2.0], &device);
    let (y, ints) = fused
        .run(&device, || {
            let ints = Tensor::<Oxi, 1, Int>::random([4], Distribution::Uniform(0.0, 9.0), &device);
            (x.clone() * 2.0, ints)
        })
        .unwrap();
    assert_eq!(fused.stats().eager_fallbacks, 1);
    // The first read after a failed op reports its error (eager mode's rule), then the
    // other results read as usual.
    let fused_error = format!("{:?}", ints.try_into_data().expect_err("the op, replayed"));
    assert!(
        fused_error.contains("IntRandom) is not lowered"),
        "{fused_error}"
    );
    assert_eq!(values(y).1, vec![2.0, 4.0]);
    let eager = Tensor::<Oxi, 1, Int>::random([4], Distribution::Uniform(0.0, 9.0), &device)
        .try_into_data()
        .expect_err("integer random draws are not lowered");
    assert!(
        format!("{eager:?}").contains("IntRandom) is not lowered"),
        "{eager:?}"
    );
}
