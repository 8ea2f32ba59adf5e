//! The PJRT runtime layer against the real XLA CPU plugin
//! (`tools/fetch-plugins.sh --only cpu`).

mod common;

use std::time::Instant;

use half::bf16;
use oxidiff_backend_tpu::pjrt::{
    Client, CompileOptions, ElementType, Error, ErrorCode, NamedValue, Plugin, PluginKind, Shape,
};

fn two_device_client(plugin: &Plugin) -> Client {
    let client = plugin
        .client_with_options(&[("cpu_device_count", NamedValue::Int64(2))])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(client.platform_name(), "cpu");
    client
}

#[test]
fn cpu_plugin_loads_with_a_supported_api_version() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let (major, minor) = plugin.api_version();
    assert_eq!(major, 0);
    assert!(
        minor >= oxidiff_backend_tpu::pjrt::MIN_API_MINOR,
        "API 0.{minor}"
    );
    assert_eq!(plugin.kind(), Some(PluginKind::XlaCpu));
    eprintln!(
        "{}: API {major}.{minor}, function table {} bytes, attributes {:?}",
        plugin.path().display(),
        plugin.api_table_size(),
        plugin.attributes()
    );
    // Loading again gives the same, already initialized plugin.
    let again = Plugin::load(plugin.path()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again.path(), plugin.path());
}

#[test]
fn cpu_device_count_option_gives_two_devices() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = two_device_client(&plugin);
    let devices = client.devices();
    assert_eq!(devices.len(), 2);
    assert_eq!(client.global_device_count(), 2);
    assert_eq!(devices[0].index(), 0);
    assert_eq!(devices[1].index(), 1);
    assert_ne!(devices[0].id(), devices[1].id());
    eprintln!(
        "platform {} {}; devices {:?} ({})",
        client.platform_name(),
        client.platform_version(),
        devices,
        devices[0].debug_string()
    );
}

#[test]
fn device_index_out_of_range_is_an_error() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = two_device_client(&plugin);
    match client.device(2) {
        Err(Error::DeviceIndexOutOfRange {
            index: 2, count: 2, ..
        }) => {}
        other => panic!("expected DeviceIndexOutOfRange, got {other:?}"),
    }
}

#[test]
fn buffers_round_trip_f32_bf16_i64() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = two_device_client(&plugin);
    let device = client.device(1).unwrap_or_else(|e| panic!("{e}"));

    let f32s = [1.0f32, -2.5, 3.25, f32::MAX, f32::MIN_POSITIVE, 0.0];
    let buffer = client
        .buffer_from_slice(&f32s, &[2, 3], &device)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        buffer.shape().ok(),
        Some(Shape::new(ElementType::F32, [2, 3]))
    );
    assert_eq!(buffer.device().ok(), Some(device.clone()));
    assert!(buffer.on_device_size().unwrap_or(0) >= 24);
    assert_eq!(buffer.to_vec::<f32>().ok(), Some(f32s.to_vec()));

    let bf16s: Vec<bf16> = [0.5f32, -1.0, 3.0, 65504.0]
        .iter()
        .map(|&v| bf16::from_f32(v))
        .collect();
    let buffer = client
        .buffer_from_slice(&bf16s, &[4], &device)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(buffer.element_type().ok(), Some(ElementType::BF16));
    assert_eq!(buffer.to_vec::<bf16>().ok(), Some(bf16s));

    let i64s = [i64::MIN, -1, 0, 1, i64::MAX, 42];
    let buffer = client
        .buffer_from_slice(&i64s, &[3, 2], &device)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(buffer.dims().ok(), Some(vec![3, 2]));
    assert_eq!(buffer.to_vec::<i64>().ok(), Some(i64s.to_vec()));
    // The raw bytes are the little-endian host layout.
    let bytes = buffer.to_host().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&bytes[8..16], &(-1i64).to_le_bytes());

    // Reading with the wrong type is refused, not reinterpreted.
    assert!(matches!(
        buffer.to_vec::<f64>(),
        Err(Error::InvalidArgument(_))
    ));
    // Host data that does not match the shape is refused.
    let short = client.buffer_from_host(&[0u8; 7], &Shape::new(ElementType::F32, [2]), &device);
    assert!(matches!(short, Err(Error::InvalidArgument(_))));
}

/// A strided view of host bytes arrives dense: the transpose of a `[2, 3]` array, and a slice
/// of its second row; a view that would read past the bytes, or a negative stride, is refused
/// before the plugin sees it.
#[test]
fn strided_host_views_arrive_dense_and_views_past_the_bytes_are_refused() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = two_device_client(&plugin);
    let device = client.device(0).unwrap_or_else(|e| panic!("{e}"));
    let values = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let shape = |dims: &[i64]| Shape::new(ElementType::F32, dims.to_vec());
    // [3, 2] transpose of the row-major [2, 3]: row stride 4 bytes, column stride 12.
    let transposed = client
        .buffer_from_strided_host(&bytes, 0, &shape(&[3, 2]), &[4, 12], &device)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        transposed.to_vec::<f32>().ok(),
        Some(vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0])
    );
    // Elements 1..3 of row 1.
    let slice = client
        .buffer_from_strided_host(&bytes, 16, &shape(&[1, 2]), &[12, 4], &device)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(slice.to_vec::<f32>().ok(), Some(vec![5.0, 6.0]));
    for (offset, dims, strides) in [
        (4usize, vec![3i64, 2], vec![4i64, 12]),
        (0, vec![2, 4], vec![12, 4]),
        (0, vec![2, 3], vec![-12, 4]),
        (0, vec![2, 3], vec![12]),
    ] {
        let refused =
            client.buffer_from_strided_host(&bytes, offset, &shape(&dims), &strides, &device);
        assert!(
            matches!(refused, Err(Error::InvalidArgument(_))),
            "{offset} {dims:?} {strides:?}"
        );
    }
}

#[test]
fn add_module_compiles_and_executes() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = two_device_client(&plugin);
    let device = client.device(0).unwrap_or_else(|e| panic!("{e}"));

    let start = Instant::now();
    let exe = client
        .compile(&common::add_module("f32"), &CompileOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let compile_time = start.elapsed();
    assert_eq!(exe.num_outputs(), 1);
    assert_eq!(exe.addressable_devices(), vec![device.clone()]);

    let a = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let b = [0.5f32, -2.0, 10.0, 0.25, -5.0, 1e6];
    let a_buf = client
        .buffer_from_slice(&a, &[2, 3], &device)
        .unwrap_or_else(|e| panic!("{e}"));
    let b_buf = client
        .buffer_from_slice(&b, &[2, 3], &device)
        .unwrap_or_else(|e| panic!("{e}"));

    let mut times = Vec::new();
    let mut result = Vec::new();
    for _ in 0..20 {
        let start = Instant::now();
        let outputs = exe
            .execute(&[&a_buf, &b_buf])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(outputs.len(), 1);
        outputs[0].ready().unwrap_or_else(|e| panic!("{e}"));
        times.push(start.elapsed());
        result = outputs[0].to_vec::<f32>().unwrap_or_else(|e| panic!("{e}"));
    }
    times.sort();
    eprintln!(
        "add 2x3 f32: compile {compile_time:?}, execute median {:?}",
        times[times.len() / 2]
    );
    // f32 addition of these values is exact.
    let expected: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(result, expected);

    // The executable serializes (XLA CPU supports it).
    let serialized = exe.serialize().unwrap_or_else(|e| panic!("{e}"));
    assert!(!serialized.is_empty());
}

#[test]
fn executable_compiled_for_the_second_device_runs_there() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = two_device_client(&plugin);
    let second = client.device(1).unwrap_or_else(|e| panic!("{e}"));
    let exe = client
        .compile(
            &common::add_module("i64"),
            &CompileOptions::on_device(second.id() as i64),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(exe.addressable_devices(), vec![second.clone()]);
    let x = client
        .buffer_from_slice(&[1i64, 2, 3, 4, 5, 6], &[2, 3], &second)
        .unwrap_or_else(|e| panic!("{e}"));
    let out = exe.execute(&[&x, &x]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out[0].device().ok(), Some(second));
    assert_eq!(out[0].to_vec::<i64>().ok(), Some(vec![2, 4, 6, 8, 10, 12]));
}

#[test]
fn dot_and_conv_modules_match_host_math() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = two_device_client(&plugin);
    let device = client.device(0).unwrap_or_else(|e| panic!("{e}"));

    // Small integers: exact in bf16 and in f32 accumulation.
    let a: Vec<f32> = (0..32).map(|i| (i % 5) as f32 - 2.0).collect();
    let b: Vec<f32> = (0..128).map(|i| (i % 7) as f32 - 3.0).collect();
    let to_bf16 = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
    let start = Instant::now();
    let dot = client
        .compile(common::DOT_MODULE, &CompileOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let dot_compile = start.elapsed();
    let a_buf = client
        .buffer_from_slice(&to_bf16(&a), &[4, 8], &device)
        .unwrap_or_else(|e| panic!("{e}"));
    let b_buf = client
        .buffer_from_slice(&to_bf16(&b), &[8, 16], &device)
        .unwrap_or_else(|e| panic!("{e}"));
    let out = dot
        .execute(&[&a_buf, &b_buf])
        .unwrap_or_else(|e| panic!("{e}"));
    let got = out[0].to_vec::<f32>().unwrap_or_else(|e| panic!("{e}"));
    let mut expected = vec![0f32; 64];
    for i in 0..4 {
        for j in 0..16 {
            expected[i * 16 + j] = (0..8).map(|k| a[i * 8 + k] * b[k * 16 + j]).sum();
        }
    }
    assert_eq!(got, expected);

    let x: Vec<f32> = (0..256).map(|i| ((i * 7) % 11) as f32 / 8.0).collect();
    let w: Vec<f32> = (0..288)
        .map(|i| ((i * 5) % 13) as f32 / 16.0 - 0.375)
        .collect();
    let start = Instant::now();
    let conv = client
        .compile(common::CONV_MODULE, &CompileOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let conv_compile = start.elapsed();
    let x_buf = client
        .buffer_from_slice(&x, &[1, 8, 8, 4], &device)
        .unwrap_or_else(|e| panic!("{e}"));
    let w_buf = client
        .buffer_from_slice(&w, &[3, 3, 4, 8], &device)
        .unwrap_or_else(|e| panic!("{e}"));
    let out = conv
        .execute(&[&x_buf, &w_buf])
        .unwrap_or_else(|e| panic!("{e}"));
    let got = out[0].to_vec::<f32>().unwrap_or_else(|e| panic!("{e}"));
    let mut expected = vec![0f32; got.len()];
    for oy in 0..8i64 {
        for ox in 0..8i64 {
            for o in 0..8usize {
                let mut acc = 0f32;
                for ky in 0..3i64 {
                    for kx in 0..3i64 {
                        let (iy, ix) = (oy + ky - 1, ox + kx - 1);
                        if !(0..8).contains(&iy) || !(0..8).contains(&ix) {
                            continue;
                        }
                        for c in 0..4usize {
                            let xv = x[((iy * 8 + ix) * 4) as usize + c];
                            let wv = w[((ky * 3 + kx) as usize * 4 + c) * 8 + o];
                            acc += xv * wv;
                        }
                    }
                }
                expected[((oy * 8 + ox) * 8) as usize + o] = acc;
            }
        }
    }
    let worst = oxidiff_test_support::worst_difference("conv", &got, &expected);
    let max_err = worst.difference;
    eprintln!("dot bf16 compile {dot_compile:?}, conv 3x3 compile {conv_compile:?}, conv max error {max_err}");
    // 36-term f32 sums of values below 2 in magnitude: summation-order error
    // stays far below 1e-4.
    assert!(max_err < 1e-4, "conv max error {max_err}; {worst}");
}

#[test]
fn buffer_copies_to_the_second_device() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = two_device_client(&plugin);
    let first = client.device(0).unwrap_or_else(|e| panic!("{e}"));
    let second = client.device(1).unwrap_or_else(|e| panic!("{e}"));
    let data = [1.5f32, 2.5, -3.5];
    let on_first = client
        .buffer_from_slice(&data, &[3], &first)
        .unwrap_or_else(|e| panic!("{e}"));
    let on_second = on_first
        .copy_to_device(&second)
        .unwrap_or_else(|e| panic!("{e}"));
    drop(on_first);
    assert_eq!(on_second.device().ok(), Some(second));
    assert_eq!(on_second.to_vec::<f32>().ok(), Some(data.to_vec()));
}

#[test]
fn two_device_spmd_add_runs_one_shard_per_device() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = two_device_client(&plugin);
    let devices = client.devices();
    let module = r#"module @spmd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%a: tensor<2x4xf32> {mhlo.sharding = "{devices=[1,2]0,1}"}) -> (tensor<2x4xf32> {mhlo.sharding = "{devices=[1,2]0,1}"}) {
    %0 = stablehlo.add %a, %a : tensor<2x4xf32>
    return %0 : tensor<2x4xf32>
  }
}
"#;
    let ids: Vec<i64> = devices.iter().map(|d| d.id() as i64).collect();
    let exe = client
        .compile(module, &CompileOptions::spmd(&ids))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(exe.addressable_devices(), devices);
    // Column halves of [[0,1,2,3],[4,5,6,7]].
    let left = client
        .buffer_from_slice(&[0f32, 1., 4., 5.], &[2, 2], &devices[0])
        .unwrap_or_else(|e| panic!("{e}"));
    let right = client
        .buffer_from_slice(&[2f32, 3., 6., 7.], &[2, 2], &devices[1])
        .unwrap_or_else(|e| panic!("{e}"));
    let out = exe
        .execute_sharded(&[&[&left], &[&right]])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.len(), 2);
    assert_eq!(out[0][0].to_vec::<f32>().ok(), Some(vec![0., 2., 8., 10.]));
    assert_eq!(out[1][0].to_vec::<f32>().ok(), Some(vec![4., 6., 12., 14.]));
}

#[test]
fn malformed_mlir_reports_the_plugin_message() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = two_device_client(&plugin);
    let bad = "module { func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> { %0 = stablehlo.bogus_op %a : tensor<2xf32> return %0 : tensor<2xf32> } }";
    match client.compile(bad, &CompileOptions::default()) {
        Err(Error::Pjrt {
            function,
            code,
            message,
        }) => {
            assert_eq!(function, "PJRT_Client_Compile");
            // The CPU plugin reports parse failures as UNKNOWN; the message
            // names the offending op.
            assert_ne!(code, ErrorCode::Other(0), "{message}");
            assert!(message.contains("bogus_op"), "{message}");
        }
        other => panic!("expected a PJRT compile error, got {other:?}"),
    }
}

#[test]
fn executing_with_the_wrong_arguments_is_an_error() {
    let Some(plugin) = common::plugin("xla:cpu") else {
        return;
    };
    let client = two_device_client(&plugin);
    let device = client.device(0).unwrap_or_else(|e| panic!("{e}"));
    let exe = client
        .compile(&common::add_module("f32"), &CompileOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let one = client
        .buffer_from_slice(&[1f32; 6], &[2, 3], &device)
        .unwrap_or_else(|e| panic!("{e}"));
    match exe.execute(&[&one]) {
        Err(Error::Pjrt {
            function, message, ..
        }) => {
            assert_eq!(function, "PJRT_LoadedExecutable_Execute");
            eprintln!("one argument for two: {message}");
        }
        other => panic!("expected a PJRT execute error, got {other:?}"),
    }
    // A buffer of another client is refused before reaching the plugin.
    let other_client = two_device_client(&plugin);
    let other_device = other_client.device(0).unwrap_or_else(|e| panic!("{e}"));
    let foreign = other_client
        .buffer_from_slice(&[1f32; 6], &[2, 3], &other_device)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        exe.execute(&[&one, &foreign]),
        Err(Error::ForeignObject { .. })
    ));
}

#[test]
fn a_file_that_is_not_a_plugin_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let dir = tmp.path();
    let text = dir.join("libnot_a_plugin.so");
    std::fs::write(&text, "this is not an ELF file").unwrap_or_else(|e| panic!("{e}"));
    match Plugin::load(&text) {
        Err(e @ Error::Load { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("libnot_a_plugin.so"), "{msg}");
            eprintln!("{msg}");
        }
        other => panic!("expected a load error, got {other:?}"),
    }
    match Plugin::load(dir.join("missing.so")) {
        Err(Error::Load { .. }) => {}
        other => panic!("expected a load error, got {other:?}"),
    }
    // A real shared library without GetPjrtApi.
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib64/libm.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists());
    if let Some(libm) = libm {
        match Plugin::load(libm) {
            Err(e @ Error::NotAPlugin { .. }) => {
                assert!(e.to_string().contains("GetPjrtApi"), "{e}")
            }
            other => panic!("expected NotAPlugin, got {other:?}"),
        }
    }
}

#[test]
fn unknown_names_and_missing_plugins_say_what_to_do() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        Plugin::discover("quantum"),
        Err(Error::UnknownPluginName(_))
    ));
    let search = oxidiff_backend_tpu::pjrt::PluginSearch {
        plugin_dirs: vec![tmp.path().join("oxidiff-no-plugins-here")],
        ..Default::default()
    };
    match search.locate(PluginKind::XlaCpu) {
        Err(e @ Error::PluginNotFound { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("oxidiff-no-plugins-here"), "{msg}");
            assert!(msg.contains("fetch-plugins.sh"), "{msg}");
            assert!(
                msg.contains("pip install lammps-jax-pjrt-cpu==0.11.2"),
                "{msg}"
            );
        }
        other => panic!("expected PluginNotFound, got {other:?}"),
    }
}
