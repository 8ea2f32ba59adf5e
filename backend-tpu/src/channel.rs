//! The burn-router channel of the [`Oxi`](crate::Oxi) backend: one client per
//! device, burn-flex's runner for the CPU and the eager PJRT client for PJRT
//! devices, and a bridge that moves tensors between them through host memory.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Wake};

use burn_backend::{DType, DTypeUsageSet, ExecutionError, Shape, TensorData};
use burn_flex::{Flex, FlexDevice};
use burn_ir::{OperationIr, TensorId, TensorIr};
use burn_router::{MultiBackendBridge, RouterTensor, Runner, RunnerChannel, RunnerClient};

use crate::device::OxiDevice;
use crate::eager::PjrtClient;

/// The channel: which client serves a device, and how tensors move.
#[derive(Clone, Default)]
pub struct OxiChannel;

/// The client of one device.
#[derive(Clone)]
pub enum OxiClient {
    /// burn-flex on the host, through burn-router's own runner.
    Cpu(Runner<Flex>),
    /// A PJRT device, in eager mode.
    Pjrt(PjrtClient),
}

impl RunnerClient for OxiClient {
    type Device = OxiDevice;

    fn register_op(&self, op: OperationIr) {
        match self {
            Self::Cpu(runner) => runner.register_op(op),
            Self::Pjrt(client) => client.register_op(op),
        }
    }

    fn read_tensor_async(
        &self,
        tensor: TensorIr,
    ) -> Pin<Box<dyn Future<Output = Result<TensorData, ExecutionError>> + Send>> {
        match self {
            Self::Cpu(runner) => runner.read_tensor_async(tensor),
            Self::Pjrt(client) => {
                let result = client.read_tensor(tensor);
                Box::pin(async move { result })
            }
        }
    }

    fn sync(&self) -> Result<(), ExecutionError> {
        match self {
            Self::Cpu(runner) => runner.sync(),
            Self::Pjrt(client) => client.sync(),
        }
    }

    fn create_empty_handle(&self) -> TensorId {
        match self {
            Self::Cpu(_) => cpu_tensor_id(),
            Self::Pjrt(client) => client.create_empty_handle(),
        }
    }

    fn register_tensor_data(&self, data: TensorData) -> RouterTensor<Self> {
        let ir = match self {
            Self::Cpu(runner) => {
                let (id, shape, dtype) = (cpu_tensor_id(), data.shape.clone(), data.dtype);
                runner.register_tensor_data_id(id, data);
                return RouterTensor::new(id, shape, dtype, self.clone());
            }
            Self::Pjrt(client) => client.register_tensor_data_ir(data),
        };
        RouterTensor::new(ir.id, ir.shape, ir.dtype, self.clone())
    }

    fn device(&self) -> OxiDevice {
        match self {
            Self::Cpu(_) => OxiDevice::Cpu,
            Self::Pjrt(client) => client.device(),
        }
    }

    fn seed(&self, seed: u64) {
        match self {
            Self::Cpu(runner) => runner.seed(seed),
            Self::Pjrt(client) => client.seed(seed),
        }
    }

    fn dtype_usage(&self, dtype: DType) -> DTypeUsageSet {
        match self {
            Self::Cpu(runner) => runner.dtype_usage(dtype),
            Self::Pjrt(client) => client.dtype_usage(dtype),
        }
    }
}

/// A new id for a tensor of the CPU device. burn-router's runner counts its ids in a `static`
/// of its own, which evcxr's cells each have a copy of; the shared runner's ids come from one
/// process-wide counter instead ([`crate::process`]).
fn cpu_tensor_id() -> TensorId {
    struct Ids(AtomicU64);
    static IDS: OnceLock<&'static Ids> = OnceLock::new();
    let ids = IDS.get_or_init(|| crate::process::shared(|| Ids(AtomicU64::new(0))));
    TensorId::new(ids.0.fetch_add(1, Ordering::Relaxed))
}

/// Moves tensors between devices as host data: the handle of a tensor in
/// transit is its [`TensorData`], read from the source device
/// ([`RunnerClient::read_tensor_async`]) and registered on the target
/// ([`RunnerClient::register_tensor_data`]).
pub struct HostBridge;

impl MultiBackendBridge for HostBridge {
    type TensorHandle = TensorData;
    type Device = OxiDevice;

    fn change_backend_float(data: TensorData, _shape: Shape, _target: &OxiDevice) -> TensorData {
        data
    }

    fn change_backend_int(data: TensorData, _shape: Shape, _target: &OxiDevice) -> TensorData {
        data
    }

    fn change_backend_bool(data: TensorData, _shape: Shape, _target: &OxiDevice) -> TensorData {
        data
    }
}

impl RunnerChannel for OxiChannel {
    type Device = OxiDevice;
    type Bridge = HostBridge;
    type Client = OxiClient;
    type FloatElem = f32;
    type IntElem = i32;
    type BoolElem = bool;

    fn name(device: &OxiDevice) -> String {
        match device {
            OxiDevice::Cpu => "flex".to_string(),
            OxiDevice::Pjrt { .. } => format!("pjrt<{device}>"),
        }
    }

    /// The device's one client of the process ([`crate::process`]): every copy of this
    /// crate in the process (evcxr's cells) serves a device's tensors from the same client.
    fn init_client(device: &OxiDevice) -> OxiClient {
        #[derive(Default)]
        struct Clients(Mutex<HashMap<OxiDevice, OxiClient>>);
        static CLIENTS: OnceLock<&'static Clients> = OnceLock::new();
        let clients = CLIENTS.get_or_init(|| crate::process::shared(Clients::default));
        let mut clients = clients.0.lock().unwrap_or_else(|p| p.into_inner());
        clients
            .entry(device.clone())
            .or_insert_with(|| match device {
                OxiDevice::Cpu => OxiClient::Cpu(Runner::new(FlexDevice)),
                OxiDevice::Pjrt { platform, index } => {
                    OxiClient::Pjrt(PjrtClient::new(platform.clone(), *index))
                }
            })
            .clone()
    }

    /// Reads the tensor to the host. A failed read (an earlier operation of
    /// that device failed) cannot be returned from here: it panics with the
    /// recorded error.
    fn get_tensor_handle(tensor: &TensorIr, client: &OxiClient) -> TensorData {
        let device = client.device();
        match block_on(client.read_tensor_async(tensor.clone())) {
            Ok(data) => data,
            Err(e) => panic!("moving a tensor off {device} failed: {e}"),
        }
    }

    fn register_tensor(
        client: &OxiClient,
        data: TensorData,
        _shape: Shape,
        _dtype: DType,
    ) -> RouterTensor<OxiClient> {
        client.register_tensor_data(data)
    }
}

/// The eager client of a PJRT device (for its [`Stats`](crate::eager::Stats) and test hooks such as
/// [`PjrtClient::inject_fault`]); `None` for the CPU device.
pub fn pjrt_client(device: &OxiDevice) -> Option<PjrtClient> {
    match burn_router::get_client::<OxiChannel>(device) {
        OxiClient::Pjrt(client) => Some(client),
        OxiClient::Cpu(_) => None,
    }
}

/// Runs a future to completion on this thread (reads here are ready at once
/// or finish on another thread that wakes this one).
pub(crate) fn block_on<F: Future>(future: F) -> F::Output {
    struct ThreadWaker(std::thread::Thread);
    impl Wake for ThreadWaker {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(ThreadWaker(std::thread::current())).into();
    let mut context = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        match future.as_mut().poll(&mut context) {
            Poll::Ready(value) => return value,
            Poll::Pending => std::thread::park(),
        }
    }
}
