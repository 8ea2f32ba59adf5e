//! libtpu on a machine without a TPU: client creation fails fast with "no TPU",
//! and ahead-of-time compilation for a TPU topology works
//! (`tools/fetch-plugins.sh --only tpu`). Its own test binary, so libtpu and
//! the environment it needs stay out of the CPU plugin's process.

mod common;

use std::time::{Duration, Instant};

use oxidiff_test_support::Deadline;

use oxidiff_backend_tpu::pjrt::{tpu_device_present, CompileOptions, Error, PluginKind};

#[test]
fn libtpu_without_a_tpu_fails_fast_with_no_tpu() {
    let start = Instant::now();
    let Some(plugin) = common::plugin("tpu") else {
        return;
    };
    let load_time = start.elapsed();
    assert_eq!(plugin.kind(), Some(PluginKind::Tpu));
    let (major, minor) = plugin.api_version();
    eprintln!(
        "{}: API {major}.{minor}, function table {} bytes, loaded in {load_time:?}",
        plugin.path().display(),
        plugin.api_table_size()
    );
    if tpu_device_present() {
        let client = plugin.client().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(client.platform_name(), "tpu");
        return;
    }
    assert_eq!(
        std::env::var("TPU_SKIP_MDS_QUERY").ok().as_deref(),
        Some("1")
    );
    // "Fast": without TPU_SKIP_MDS_QUERY libtpu retries a metadata server for minutes; a
    // hang ends the test process after a generous deadline (no timing assertion).
    let deadline = Deadline::exit_process("libtpu client creation", Duration::from_secs(300));
    let start = Instant::now();
    match plugin.client() {
        Err(e @ Error::NoTpu { .. }) => {
            eprintln!("client creation failed after {:?}: {e}", start.elapsed());
            assert!(
                e.to_string().contains("no TPU found on this machine"),
                "{e}"
            );
        }
        other => panic!("expected NoTpu, got {other:?}"),
    }
    drop(deadline);
}

#[test]
fn libtpu_compiles_add_dot_and_conv_for_a_v5e_topology() {
    let Some(plugin) = common::plugin("tpu") else {
        return;
    };
    let topology = plugin
        .topology("v5e:2x2x1", &[])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(topology.platform_name().ok().as_deref(), Some("tpu"));
    let devices = topology.devices().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(devices.len(), 4, "{devices:?}");
    eprintln!(
        "v5e:2x2x1 devices: {:?}",
        devices
            .iter()
            .map(|d| (d.id, d.kind.as_str()))
            .collect::<Vec<_>>()
    );

    for (name, module) in [
        ("add f32", common::add_module("f32")),
        ("dot bf16", common::DOT_MODULE.to_string()),
        ("conv 3x3 f32", common::CONV_MODULE.to_string()),
    ] {
        let start = Instant::now();
        let exe = topology
            .compile(&module, &CompileOptions::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let compile_time = start.elapsed();
        assert_eq!(exe.num_outputs().ok(), Some(1), "{name}");
        let serialized = exe.serialize().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!serialized.is_empty(), "{name}");
        eprintln!(
            "{name}: compiled for TPU v5e in {compile_time:?}, {} serialized bytes",
            serialized.len()
        );
    }

    // Malformed MLIR carries libtpu's message.
    match topology.compile("module { this is not mlir }", &CompileOptions::default()) {
        Err(Error::Pjrt {
            function, message, ..
        }) => {
            assert_eq!(function, "PJRT_Compile");
            assert!(!message.is_empty());
        }
        other => panic!("expected a PJRT compile error, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn unknown_topology_is_a_pjrt_error() {
    let Some(plugin) = common::plugin("tpu") else {
        return;
    };
    match plugin.topology("v99x:1x1x1", &[]) {
        Err(Error::Pjrt {
            function, message, ..
        }) => {
            assert_eq!(function, "PJRT_TopologyDescription_Create");
            eprintln!("unknown topology: {message}");
        }
        other => panic!("expected a PJRT error, got {other:?}"),
    }
}

/// Every op the tiny SD 1.x models (CLIP, UNet, VAE) send, plus a sample of
/// the other lowered ops, is recorded on the `Traced` backend, lowered one op
/// per module as eager mode does, and compiled ahead of time for a TPU v5e.
#[test]
fn every_lowered_op_of_the_tiny_models_compiles_for_tpu_v5e() {
    use burn::tensor::{Distribution, Tensor, TensorData};
    use oxidiff_backend_tpu::lowering::lower_op;
    use oxidiff_backend_tpu::trace::{take_ops, Traced};
    use oxidiff_backend_tpu::OxiDevice;
    use oxidiff_models::{AutoencoderKL, ClipTextModel, UNet2DConditionModel};

    let Some(plugin) = common::plugin("tpu") else {
        return;
    };
    let topology = plugin
        .topology("v5e:2x2x1", &[])
        .unwrap_or_else(|e| panic!("{e}"));
    let device = OxiDevice::Cpu;
    let dir =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-sd1");

    let clip = ClipTextModel::<Traced>::from_dir(&dir.join("text_encoder"), false, None, &device)
        .unwrap_or_else(|e| panic!("{e}"));
    let ids = vec![vec![49406u32, 320, 1929, 49407, 49407]];
    let encoded = clip.forward(&ids, false).unwrap_or_else(|e| panic!("{e}"));
    let unet = UNet2DConditionModel::<Traced>::from_dir(&dir.join("unet"), None, &device)
        .unwrap_or_else(|e| panic!("{e}"));
    let latents = Tensor::<Traced, 4>::zeros([1, 4, 16, 16], &device);
    let timestep = Tensor::<Traced, 1>::from_data(TensorData::new(vec![500.0f32], [1]), &device);
    let noise = unet.forward(latents, timestep, encoded.last_hidden_state);
    let vae = AutoencoderKL::<Traced>::from_dir(&dir.join("vae"), None, &device)
        .unwrap_or_else(|e| panic!("{e}"));
    let _image = vae.decode(noise);

    // A sample of the ops the models do not use.
    let x = Tensor::<Traced, 3>::random([2, 3, 8], Distribution::Normal(0.0, 1.0), &device);
    let bf = x.clone().cast(burn::tensor::DType::BF16);
    let _ = bf.clone().matmul(bf.swap_dims(1, 2));
    let _ = x.clone().argmax(2);
    let _ = x.clone().powf_scalar(2.5).clamp(-1.0, 1.0);
    let _ = x.clone().sum_dim(1).max_dim(2);
    let _ = x.clone().remainder_scalar(0.7);
    let _ = x.clone().cumsum(2);
    let _ = x.clone().max_dim_with_indices(1);
    let indices = Tensor::<Traced, 3, burn::tensor::Int>::zeros([2, 3, 8], &device);
    let _ = x
        .clone()
        .scatter(1, indices, x.clone(), burn::tensor::IndexingUpdateOp::Add);
    let _ = x.clone().int().matmul(x.clone().int().swap_dims(1, 2));
    let image = Tensor::<Traced, 4>::zeros([1, 4, 6, 6], &device);
    let _ = burn::tensor::module::max_pool2d(image.clone(), [3, 3], [2, 2], [1, 1], [1, 1], false);
    let _ = burn::tensor::module::avg_pool2d(image.clone(), [2, 2], [2, 2], [0, 0], true, false);
    let _ = burn::tensor::module::conv_transpose2d(
        image.clone(),
        Tensor::zeros([4, 2, 3, 3], &device),
        None,
        burn::tensor::ops::ConvTransposeOptions::new([2, 2], [1, 1], [1, 1], [1, 1], 2),
    );
    let _ = burn::tensor::module::interpolate(
        image,
        [9, 9],
        burn::tensor::ops::InterpolateOptions::new(burn::tensor::ops::InterpolateMode::Bilinear),
    );
    let _ = burn::tensor::module::attention(
        x.clone().unsqueeze::<4>(),
        x.clone().unsqueeze::<4>(),
        x.unsqueeze::<4>(),
        None,
        None,
        burn::tensor::ops::AttentionModuleOptions {
            is_causal: true,
            ..Default::default()
        },
    );

    let ops = take_ops(&device);
    let mut modules = std::collections::BTreeMap::new();
    for op in &ops {
        let function = lower_op(op).unwrap_or_else(|e| panic!("{e}"));
        modules
            .entry(function.module)
            .or_insert_with(|| oxidiff_backend_tpu::lowering::op_name(op));
    }
    eprintln!(
        "{} ops recorded, {} distinct modules",
        ops.len(),
        modules.len()
    );
    // Two threads: the machines this runs on have two cores.
    let start = Instant::now();
    let modules: Vec<(String, String)> = modules.into_iter().collect();
    let per_op = std::sync::Mutex::new(std::collections::BTreeMap::<String, usize>::new());
    std::thread::scope(|scope| {
        for half in modules.chunks(modules.len().div_ceil(2).max(1)) {
            let (topology, per_op) = (&topology, &per_op);
            scope.spawn(move || {
                for (module, name) in half {
                    let exe = topology
                        .compile(module, &CompileOptions::default())
                        .unwrap_or_else(|e| {
                            panic!("{name} does not compile for TPU: {e}\n{module}")
                        });
                    assert!(exe.num_outputs().is_ok_and(|n| n >= 1), "{name}");
                    *per_op
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(name.clone())
                        .or_default() += 1;
                }
            });
        }
    });
    let per_op = per_op.into_inner().unwrap_or_else(|p| p.into_inner());
    eprintln!(
        "compiled {} modules for TPU v5e in {:?}; per op: {per_op:?}",
        modules.len(),
        start.elapsed()
    );
}

/// `"tpu"` as an `Oxi` device: usable where there is a TPU, refused with
/// libtpu's reason where there is none.
#[test]
fn tpu_device_string_is_checked_when_parsed() {
    use oxidiff_backend_tpu::{DeviceError, OxiDevice};

    if common::plugin("tpu").is_none() {
        return;
    }
    match "tpu:0".parse::<OxiDevice>() {
        Ok(device) => assert!(tpu_device_present(), "parsed {device} without a TPU"),
        Err(e @ DeviceError::Pjrt { .. }) => {
            assert!(!tpu_device_present(), "{e}");
            let message = e.to_string();
            assert!(
                message.starts_with("device tpu:0: no TPU found"),
                "{message}"
            );
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
}
