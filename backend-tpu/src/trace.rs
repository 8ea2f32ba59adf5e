//! Recording ops instead of running them: [`Traced`] is a Burn backend whose
//! tensors have shapes and dtypes but no values, and whose ops are kept, in
//! order, per device. Its first use is checking lowerings without a device
//! (lower each recorded op, compile it ahead of time for a TPU topology); it
//! can feed a recorded sequence to [`Lowerer`](crate::lowering::Lowerer)
//! as one function. Compiled mode ([`compiled`](crate::compiled)) records
//! through the eager client instead, so captured weights keep their buffers.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use burn_backend::{DType, DTypeUsage, DTypeUsageSet, ExecutionError, Shape, TensorData};
/// A recorded op ([`take_ops`]).
pub use burn_ir::OperationIr;
/// The IR of a traced tensor ([`float_ir`]), as the lowering takes it.
pub use burn_ir::TensorIr;
use burn_ir::{ModuleOperationIr, TensorId};
use burn_router::{get_client, BackendRouter, RouterTensor, RunnerChannel, RunnerClient};

use crate::channel::HostBridge;
use crate::device::OxiDevice;
use crate::lowering::element_type;
use crate::recording::Recording;

/// The channel of [`Traced`].
#[derive(Clone, Default)]
pub struct TraceChannel;

/// A Burn backend that records ops (see the module docs).
pub type Traced = BackendRouter<TraceChannel>;

/// The recorder of one device.
#[derive(Clone)]
pub struct TraceClient {
    device: OxiDevice,
    recording: Arc<Mutex<Recording>>,
    next_id: Arc<AtomicU64>,
}

impl TraceClient {
    /// Takes the recording so far and starts a new one.
    fn take(&self) -> Recording {
        let mut recording = self.recording.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::replace(&mut *recording, Recording::new(self.device.clone()))
    }

    /// Takes the ops recorded so far (not `Init` or `Drop`).
    pub fn take_ops(&self) -> Vec<OperationIr> {
        self.take().ops
    }
}

/// The IR of a traced float tensor (its id, shape and dtype), to declare it
/// as an input of [`lower_recorded`](crate::compiled::lower_recorded).
pub fn float_ir<const D: usize>(tensor: &burn_tensor::Tensor<Traced, D>) -> TensorIr {
    match tensor.clone().into_primitive() {
        // The clone keeps the tensor referenced, so this reads its metadata
        // without consuming or dropping it.
        burn_tensor::TensorPrimitive::Float(t) | burn_tensor::TensorPrimitive::QFloat(t) => {
            t.into_ir()
        }
    }
}

/// Takes the ops recorded on `device` so far.
pub fn take_ops(device: &OxiDevice) -> Vec<OperationIr> {
    get_client::<TraceChannel>(device).take_ops()
}

/// Takes the ops recorded on `device` so far, with the tensors they produced that are still
/// referenced (in the order produced): what a fused call
/// ([`Fused`](crate::compiled::Fused)) would make one program of, with those as its results.
pub fn take_program(device: &OxiDevice) -> (Vec<OperationIr>, Vec<TensorIr>) {
    let recording = get_client::<TraceChannel>(device).take();
    let live = recording.live();
    (recording.ops, live)
}

/// How many of `ops` are attention (Burn's `attention` module op).
pub fn attention_ops(ops: &[OperationIr]) -> usize {
    ops.iter()
        .filter(|op| matches!(op, OperationIr::Module(ModuleOperationIr::Attention(_))))
        .count()
}

impl RunnerClient for TraceClient {
    type Device = OxiDevice;

    fn register_op(&self, op: OperationIr) {
        self.recording
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .record(op);
    }

    fn read_tensor_async(
        &self,
        tensor: TensorIr,
    ) -> Pin<Box<dyn Future<Output = Result<TensorData, ExecutionError>> + Send>> {
        Box::pin(async move {
            Err(ExecutionError::WithContext {
                reason: format!("tensor {} is traced: it has no value", tensor.id),
            })
        })
    }

    fn sync(&self) -> Result<(), ExecutionError> {
        Ok(())
    }

    fn create_empty_handle(&self) -> TensorId {
        TensorId::new(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    fn register_tensor_data(&self, data: TensorData) -> RouterTensor<Self> {
        RouterTensor::new(
            self.create_empty_handle(),
            data.shape,
            data.dtype,
            self.clone(),
        )
    }

    fn device(&self) -> OxiDevice {
        self.device.clone()
    }

    fn seed(&self, _seed: u64) {}

    fn dtype_usage(&self, dtype: DType) -> DTypeUsageSet {
        match element_type(dtype) {
            Some(_) => DTypeUsage::Storage | DTypeUsage::Arithmetic,
            None => DTypeUsageSet::empty(),
        }
    }
}

impl RunnerChannel for TraceChannel {
    type Device = OxiDevice;
    type Bridge = HostBridge;
    type Client = TraceClient;
    type FloatElem = f32;
    type IntElem = i32;
    type BoolElem = bool;

    fn name(device: &OxiDevice) -> String {
        format!("trace<{device}>")
    }

    /// The device's one client of the process ([`crate::process`]).
    fn init_client(device: &OxiDevice) -> TraceClient {
        #[derive(Default)]
        struct Clients(Mutex<std::collections::HashMap<OxiDevice, TraceClient>>);
        static CLIENTS: std::sync::OnceLock<&'static Clients> = std::sync::OnceLock::new();
        let clients = CLIENTS.get_or_init(|| crate::process::shared(Clients::default));
        let mut clients = clients.0.lock().unwrap_or_else(|p| p.into_inner());
        clients
            .entry(device.clone())
            .or_insert_with(|| TraceClient {
                device: device.clone(),
                recording: Arc::new(Mutex::new(Recording::new(device.clone()))),
                next_id: Arc::default(),
            })
            .clone()
    }

    /// Traced tensors have no values to move.
    fn get_tensor_handle(tensor: &TensorIr, _client: &TraceClient) -> TensorData {
        panic!(
            "tensor {} is traced: it has no value to move to another device",
            tensor.id
        )
    }

    fn register_tensor(
        client: &TraceClient,
        data: TensorData,
        _shape: Shape,
        _dtype: DType,
    ) -> RouterTensor<TraceClient> {
        client.register_tensor_data(data)
    }
}
