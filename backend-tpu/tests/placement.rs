//! Devices of the `Oxi` backend: parsing, moving tensors between the CPU and
//! PJRT devices, and how failures surface.

mod common;

use burn::tensor::{Bool, Int, Tensor, TensorData};
use oxidiff_backend_tpu::eager::XLA_CPU_DEVICES_ENV;
use oxidiff_backend_tpu::{DeviceError, Oxi, OxiDevice};

/// Errors are recorded per device and returned by its next read, whatever
/// the thread: the tests of this file take turns so that one test's read
/// cannot take another's error.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn floats(tensor: Tensor<Oxi, 2>) -> Vec<f32> {
    match tensor.try_into_data() {
        Ok(data) => data.to_vec::<f32>().unwrap_or_else(|e| panic!("{e:?}")),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn tensors_round_trip_cpu_to_xla0_to_xla1_to_cpu() {
    let _serial = serial();
    let (Some(xla0), Some(xla1)) = (common::xla_cpu(0), common::xla_cpu(1)) else {
        return;
    };
    assert_ne!(xla0, xla1);
    let values = vec![1.5f32, -2.0, 3.25, 0.0, 7.0, -0.125];
    let cpu = Tensor::<Oxi, 2>::from_data(TensorData::new(values.clone(), [2, 3]), &OxiDevice::Cpu);
    let on0 = cpu.to_device(&xla0);
    assert_eq!(on0.device(), xla0);
    let on1 = (on0 * 2.0).to_device(&xla1);
    assert_eq!(on1.device(), xla1);
    let back = (on1 + 1.0).to_device(&OxiDevice::Cpu);
    assert_eq!(back.device(), OxiDevice::Cpu);
    let expected: Vec<f32> = values.iter().map(|v| v * 2.0 + 1.0).collect();
    assert_eq!(floats(back), expected);
}

#[test]
fn int_and_bool_tensors_move_too() {
    let _serial = serial();
    let Some(xla) = common::xla_cpu(1) else {
        return;
    };
    let ints =
        Tensor::<Oxi, 1, Int>::from_data(TensorData::new(vec![3i32, -1, 7], [3]), &OxiDevice::Cpu);
    let moved = ints.to_device(&xla) + 1;
    let back = moved.to_device(&OxiDevice::Cpu).into_data();
    assert_eq!(
        back.convert::<i32>().to_vec::<i32>().ok(),
        Some(vec![4, 0, 8])
    );

    let mask: Tensor<Oxi, 1, Bool> =
        Tensor::<Oxi, 1>::from_data(TensorData::new(vec![0.5f32, -1.0, 2.0], [3]), &xla)
            .greater_elem(0.0);
    let back = mask.to_device(&OxiDevice::Cpu).into_data();
    assert_eq!(back.to_vec::<bool>().ok(), Some(vec![true, false, true]));
}

#[test]
fn a_device_index_out_of_range_is_refused_with_the_device_count() {
    let _serial = serial();
    if common::plugin("xla:cpu").is_none() {
        return;
    }
    let count: usize = std::env::var(XLA_CPU_DEVICES_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let text = format!("xla:cpu:{count}");
    match text.parse::<OxiDevice>() {
        Err(e @ DeviceError::OutOfRange { .. }) => {
            assert_eq!(
                e.to_string(),
                format!("device {text} does not exist: this machine has {count} xla:cpu device(s)")
            );
        }
        other => panic!("expected OutOfRange, got {other:?}"),
    }
}

#[test]
fn unknown_device_names_are_refused() {
    let _serial = serial();
    for text in ["gpu", "tpu:x", "metal:0"] {
        assert!(text.parse::<OxiDevice>().is_err(), "{text}");
    }
    assert_eq!("cpu".parse::<OxiDevice>().ok(), Some(OxiDevice::Cpu));
}

/// An op with no lowering does not panic where it is issued; the next read
/// of that device returns an error naming the op.
#[test]
fn an_op_without_a_lowering_is_reported_by_name_on_the_next_read() {
    let _serial = serial();
    let Some(xla) = common::xla_cpu(0) else {
        return;
    };
    let x = Tensor::<Oxi, 2>::from_data(TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2]), &xla);
    let y: Tensor<Oxi, 3> = x.unfold(1, 2, 1);
    match y.try_into_data() {
        Err(e) => {
            let message = e.to_string();
            assert!(message.contains("Unfold"), "{message}");
            assert!(message.contains("not lowered"), "{message}");
        }
        Ok(data) => panic!("unfold is not lowered yet, but the read gave {data:?}"),
    }
    // The device keeps working afterwards.
    let z = Tensor::<Oxi, 2>::from_data(TensorData::new(vec![1.0f32, 2.0], [1, 2]), &xla) * 3.0;
    assert_eq!(floats(z), vec![3.0, 6.0]);
}

/// Buffers are freed when Burn drops or consumes their tensors, and a cached
/// executable serves repeated ops.
#[test]
fn buffers_are_freed_and_executables_reused() {
    use burn_router::get_client;
    use oxidiff_backend_tpu::{OxiChannel, OxiClient};

    let _serial = serial();
    let Some(xla) = common::xla_cpu(1) else {
        return;
    };
    let stats = || match get_client::<OxiChannel>(&xla) {
        OxiClient::Pjrt(client) => client.stats(),
        OxiClient::Cpu(_) => panic!("xla:cpu:1 has a CPU client"),
    };
    let before = stats();
    {
        let x = Tensor::<Oxi, 2>::from_data(TensorData::new(vec![0.25f32; 6], [2, 3]), &xla);
        let mut y = x.clone();
        for step in 0..10 {
            y = y.exp() * (0.5 + step as f32) + x.clone();
        }
        assert_eq!(floats(y).len(), 6);
    }
    let after = stats();
    assert_eq!(after.buffers, before.buffers, "{before:?} -> {after:?}");
    assert_eq!(
        after.executed - before.executed,
        30,
        "{before:?} -> {after:?}"
    );
    assert!(
        after.compiled - before.compiled <= 3,
        "{before:?} -> {after:?}"
    );
}

/// Which phase of [`eager_executables_are_kept_on_disk_for_a_later_process`] a child runs.
const EAGER_CACHE_PHASE: &str = "OXIDIFF_TEST_EAGER_CACHE_PHASE";

/// Eager ops keep their executables in the compile cache folder: a second process loads every
/// one and compiles none, with the same values; damaged entries are refused, compiled again and
/// reported once; an unwritable folder is reported once and only costs the compiles.
#[test]
fn eager_executables_are_kept_on_disk_for_a_later_process() {
    const NAME: &str = "eager_executables_are_kept_on_disk_for_a_later_process";
    let Some(xla) = common::xla_cpu(0) else {
        return;
    };
    if let Ok(phase) = std::env::var(EAGER_CACHE_PHASE) {
        eager_cache_phase(&phase, &xla);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let run = |phase: &str, cache: &std::path::Path| -> String {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(EAGER_CACHE_PHASE, phase)
            .env(oxidiff_backend_tpu::compile_cache::COMPILE_CACHE_ENV, cache)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            out.status.success() && stdout.contains("test result: ok. 1 passed"),
            "phase {phase}: {}\n{stdout}\n{stderr}",
            out.status
        );
        stderr
    };
    let warnings = |stderr: &str| stderr.matches("oxidiff: warning: compile cache").count();

    let first = run("compile", &cache);
    let entries: Vec<_> = std::fs::read_dir(cache.join("eager"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(
        !entries.is_empty(),
        "nothing was stored in {}",
        cache.display()
    );
    assert_eq!(warnings(&first), 0, "{first}");

    let second = run("load", &cache);
    assert_eq!(warnings(&second), 0, "{second}");

    for entry in &entries {
        let mut bytes = std::fs::read(entry).unwrap();
        *bytes.last_mut().unwrap() ^= 0x5a;
        std::fs::write(entry, bytes).unwrap();
    }
    let third = run("reject", &cache);
    assert_eq!(warnings(&third), 1, "{third}");
    assert!(third.contains("corrupt"), "{third}");
    // The rebuilt entries serve the next process again.
    run("load", &cache);

    let blocker = dir.path().join("a-file");
    std::fs::write(&blocker, b"not a folder").unwrap();
    let unwritable = run("compile", &blocker.join("cache"));
    assert_eq!(warnings(&unwritable), 1, "{unwritable}");
    assert!(unwritable.contains("could not store"), "{unwritable}");
}

/// A child of [`eager_executables_are_kept_on_disk_for_a_later_process`]: runs a few ops on
/// `xla`, checks their values against the CPU backend and what the cache did.
fn eager_cache_phase(phase: &str, xla: &OxiDevice) {
    use burn_router::get_client;
    use oxidiff_backend_tpu::{OxiChannel, OxiClient};

    let ops = |device: &OxiDevice| {
        let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.1 - 0.4).collect();
        let x = Tensor::<Oxi, 2>::from_data(TensorData::new(values, [3, 4]), device);
        floats(
            (x.clone().exp() * 0.5 + x.clone())
                .matmul(x.transpose())
                .tanh(),
        )
    };
    let expected = ops(&OxiDevice::Cpu);
    let got = ops(xla);
    for (g, e) in got.iter().zip(&expected) {
        assert!(
            (g - e).abs() <= 1e-5 * e.abs().max(1.0),
            "{got:?} vs {expected:?}"
        );
    }
    let stats = match get_client::<OxiChannel>(xla) {
        OxiClient::Pjrt(client) => client.stats(),
        OxiClient::Cpu(_) => panic!("xla:cpu:0 has a CPU client"),
    };
    println!("phase {phase}: {stats:?}");
    match phase {
        "compile" => assert!(stats.compiled > 0 && stats.disk_loads == 0, "{stats:?}"),
        "load" => assert!(
            stats.compiled == 0 && stats.disk_loads > 0 && stats.disk_rejects == 0,
            "{stats:?}"
        ),
        "reject" => assert!(
            stats.disk_rejects > 0 && stats.compiled == stats.disk_rejects,
            "{stats:?}"
        ),
        other => panic!("unknown phase {other}"),
    }
}
