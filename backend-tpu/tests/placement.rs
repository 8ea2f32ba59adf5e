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
