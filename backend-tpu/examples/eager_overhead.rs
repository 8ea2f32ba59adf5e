//! Eager-mode overheads of the `Oxi` backend on a PJRT device (default the
//! XLA CPU plugin): compiling an op the first time, dispatching a cached op,
//! and moving 1 MB to and from the device.
//!
//! `cargo run -p oxidiff-backend-tpu --example eager_overhead [device]` (the
//! workspace's dev profile builds dependencies optimized; this crate's own
//! lowering then runs unoptimized, so the numbers are an upper bound).

use std::time::{Duration, Instant};

use burn::tensor::{Tensor, TensorData};
use burn_router::get_client;
use oxidiff_backend_tpu::lowering::lower_op;
use oxidiff_backend_tpu::trace::{take_ops, Traced};
use oxidiff_backend_tpu::{Oxi, OxiChannel, OxiClient, OxiDevice};

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn stats(device: &OxiDevice) -> Option<oxidiff_backend_tpu::eager::Stats> {
    match get_client::<OxiChannel>(device) {
        OxiClient::Pjrt(client) => Some(client.stats()),
        OxiClient::Cpu(_) => None,
    }
}

fn read(tensor: Tensor<Oxi, 1>) -> Vec<f32> {
    match tensor.try_into_data() {
        Ok(data) => data.to_vec::<f32>().unwrap_or_default(),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}

fn main() {
    let name = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "xla:cpu".to_string());
    let device: OxiDevice = match name.parse() {
        Ok(device) => device,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    println!("device {device}");

    // Compile time of a first op: each length is a new module.
    let mut compiles = Vec::new();
    for n in 1..=8usize {
        let x =
            Tensor::<Oxi, 1>::from_data(TensorData::new(vec![1.0f32; 100 + n], [100 + n]), &device);
        let start = Instant::now();
        let y = read(x.exp());
        compiles.push(start.elapsed());
        assert_eq!(y.len(), 100 + n);
    }
    println!(
        "first op (lower + compile + run + read 100 floats): median {:?}, max {:?}",
        median(compiles.clone()),
        compiles.iter().max().copied().unwrap_or_default()
    );

    // Dispatch of cached ops: a chain of 1000 scalar multiplies on 1K floats.
    for len in [1usize, 1024] {
        let x = Tensor::<Oxi, 1>::from_data(TensorData::new(vec![1.0f32; len], [len]), &device);
        let warm = read(x.clone() * 1.0001);
        assert_eq!(warm.len(), len);
        let before = stats(&device);
        let ops = 1000;
        let start = Instant::now();
        let mut y = x;
        for _ in 0..ops {
            y = y * 1.0001;
        }
        let _ = read(y);
        let elapsed = start.elapsed();
        let after = stats(&device);
        println!(
            "cached op on {len} float(s): {:?} per op ({ops} ops, {:?} in all{})",
            elapsed / ops,
            elapsed,
            match (before, after) {
                (Some(b), Some(a)) => format!(", {} compile(s)", a.compiled - b.compiled),
                _ => String::new(),
            }
        );
    }

    // A cached op without a scalar argument (nothing to upload per op).
    let x = Tensor::<Oxi, 1>::from_data(TensorData::new(vec![0.5f32], [1]), &device);
    let _ = read(x.clone().cos());
    let ops = 1000;
    let start = Instant::now();
    let mut y = x;
    for _ in 0..ops {
        y = y.cos();
    }
    let _ = read(y);
    println!(
        "cached op without a scalar on 1 float: {:?} per op",
        start.elapsed() / ops
    );

    // Of which lowering (building the module text, the cache key).
    let traced = OxiDevice::Cpu;
    let t = Tensor::<Traced, 1>::from_data(TensorData::new(vec![0.5f32], [1]), &traced);
    let _ = t.cos() * 2.0;
    let ops = take_ops(&traced);
    let rounds = 10_000u32;
    let start = Instant::now();
    for _ in 0..rounds {
        for op in &ops {
            let _ = lower_op(op);
        }
    }
    println!(
        "lowering alone (cos, mul_scalar): {:?} per op",
        start.elapsed() / (rounds * ops.len() as u32)
    );

    // Transfers of 1 MB.
    let floats = 1 << 18;
    let host = vec![0.5f32; floats];
    let mut uploads = Vec::new();
    let mut downloads = Vec::new();
    for _ in 0..20 {
        let data = TensorData::new(host.clone(), [floats]);
        let start = Instant::now();
        let x = Tensor::<Oxi, 1>::from_data(data, &device);
        uploads.push(start.elapsed());
        let start = Instant::now();
        let back = x.try_into_data();
        downloads.push(start.elapsed());
        assert_eq!(back.map(|d| d.num_elements()).ok(), Some(floats));
    }
    // The same through the PJRT layer alone, to split the cost.
    let mut raw = Vec::new();
    if let OxiDevice::Pjrt { platform, index } = &device {
        if let Ok(client) = oxidiff_backend_tpu::eager::shared_client(platform) {
            if let Ok(pjrt_device) = client.device(*index) {
                for _ in 0..20 {
                    let Ok(buffer) =
                        client.buffer_from_slice(&host, &[floats as i64], &pjrt_device)
                    else {
                        break;
                    };
                    let start = Instant::now();
                    let _ = buffer.to_host();
                    raw.push(start.elapsed());
                }
            }
        }
    }
    let mb_per_s = |d: Duration| 1.0 / d.as_secs_f64();
    if !raw.is_empty() {
        println!(
            "1 MB device to host, PJRT layer alone: median {:?}",
            median(raw)
        );
    }
    let (up, down) = (median(uploads), median(downloads));
    println!(
        "1 MB host to device: median {up:?} ({:.0} MB/s); device to host: median {down:?} ({:.0} MB/s)",
        mb_per_s(up),
        mb_per_s(down)
    );
}
