//! `zbuf._core.PoolCore`: the Python face of one pool. Thin: argument checks, locking, DLPack
//! export. Policy lives in `crate::pool`; the torch-facing API in python/zbuf/pool.py.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple};

use super::buffer::DLPackBuffer;
use super::dlpack::{self, DLDevice, ExportRequest, Layout};
use super::errors::{invalid_request, new_err, to_py, Class};
use super::shared::Shared;
use crate::backend::host::HostBackend;
use crate::backend::{Backend, Device, DeviceKind};
use crate::pressure::PressureAction;
use crate::pool::{GatherPool, Lease, PoolConfig, PoolError, ReleaseOutcome};

/// Default budget: device (or host RAM) total / 32, the reference system's pool size.
pub const DEFAULT_BUDGET_DIVISOR: u64 = 32;
/// Default hard cap: total / 4, room for the scheduler to size the pool from its plan.
pub const DEFAULT_HARD_CAP_DIVISOR: u64 = 4;
/// Host total assumed when /proc/meminfo is unreadable.
const FALLBACK_HOST_TOTAL: u64 = 16 << 30;

/// A shape argument as dims: an int, or a tuple / torch.Size / list of ints. None if malformed.
/// Tuples (the hot path) get room for the strides `Layout::contiguous` appends.
fn parse_shape(shape: &Bound<'_, PyAny>) -> Option<Vec<i64>> {
    if let Ok(t) = shape.cast::<PyTuple>() {
        let mut dims = Vec::with_capacity(2 * t.len());
        for d in t.iter() {
            dims.push(d.extract::<i64>().ok()?);
        }
        return Some(dims);
    }
    if shape.is_instance_of::<PyInt>() {
        return shape.extract::<i64>().ok().map(|n| vec![n]);
    }
    if shape.is_instance_of::<PyString>() || shape.is_instance_of::<PyBytes>() {
        return None;
    }
    shape.extract::<Vec<i64>>().ok()
}

/// A count of bytes (or events) from Python: an int >= 0, not a bool.
fn byte_count(py: Python<'_>, name: &str, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    if value.is_instance_of::<PyBool>() || !value.is_instance_of::<PyInt>() {
        return Err(invalid_request(py, format!("{name} must be an int number of bytes or None, got {}", value.repr()?)));
    }
    if value.lt(0)? {
        return Err(invalid_request(py, format!("{name} must be >= 0 bytes, got {value}")));
    }
    value.extract::<u64>().map_err(|_| invalid_request(py, format!("{name}={value} does not fit in 64 bits")))
}

/// `f(arg)` without building an argument tuple (vectorcall inside CPython; stable ABI).
fn call_one<'py>(py: Python<'py>, f: &Py<PyAny>, arg: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: both are live objects (the GIL is held); the variadic list ends with NULL; the
    // result is a new reference or NULL with an exception set.
    unsafe {
        let r = pyo3::ffi::PyObject_CallFunctionObjArgs(f.as_ptr(), arg.as_ptr(), std::ptr::null_mut::<pyo3::ffi::PyObject>());
        Bound::from_owned_ptr_or_err(py, r)
    }
}

/// `tensor.untyped_storage().data_ptr()`: the block start for views and empty tensors.
fn storage_ptr(py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<u64> {
    tensor
        .call_method0(pyo3::intern!(py, "untyped_storage"))?
        .call_method0(pyo3::intern!(py, "data_ptr"))?
        .extract()
}

fn open_backend(device: Device) -> Result<Box<dyn Backend>, PoolError> {
    match device.kind {
        DeviceKind::Host => Ok(Box::new(HostBackend::new())),
        DeviceKind::Cuda => crate::backend::cuda::open(device.index),
    }
}

/// One gather-buffer pool (see python/zbuf/pool.py for the documented API).
#[pyclass(frozen, module = "zbuf._core")]
pub struct PoolCore {
    shared: Arc<Shared>,
    device: Device,
    dl_device: DLDevice,
    /// `torch._C._from_dlpack`, cached: turns a capsule into a tensor.
    from_dlpack: Py<PyAny>,
    /// `torch._C._storage_address`, cached: identity of a tensor's StorageImpl (shared by
    /// views, unique among live storages), the owner key of [Note: stale holders] in
    /// pool/mod.rs. A pybind call (~0.3 us): made only when the pool asks for the key.
    storage_address: Py<PyAny>,
    /// The torch dtype objects in `dlpack::DTYPES` order: dtypes are matched by identity.
    dtypes: Vec<Py<PyAny>>,
    /// `torch._C._cuda_getCurrentRawStream` and its argument (the device index as a Python
    /// int, built once) on CUDA pools: the default stream of a call.
    current_stream: Option<(Py<PyAny>, Py<PyAny>)>,
    /// `torch.Tensor`: `release` takes tensors (exact type checked first, by pointer).
    tensor_type: Py<PyAny>,
    /// Called with the request's byte count when the device refused an allocation even after
    /// the pool freed its idle blocks; the acquire is then retried once ([Note: reclaim hook]).
    reclaim_hook: Mutex<Option<Py<PyAny>>>,
}

impl PoolCore {
    /// Validated layout of a request: `shape` an int or a sequence of ints, `dtype` a torch
    /// dtype the DLPack export supports.
    fn layout(&self, py: Python<'_>, shape: &Bound<'_, PyAny>, dtype: &Bound<'_, PyAny>) -> PyResult<(dlpack::DLDataType, Layout)> {
        let code = self
            .dtypes
            .iter()
            .position(|d| d.as_ptr() == dtype.as_ptr())
            .ok_or_else(|| {
                new_err(py, Class::UnsupportedDtype, format!(
                    "dtype {dtype} cannot be exported by the pool: use one of {}",
                    dlpack::TORCH_DTYPE_NAMES.join(", ")
                ))
            })?;
        let (dt, itemsize) = dlpack::dtype(code as u32).expect("tables have the same length");
        let dims = parse_shape(shape).ok_or_else(|| {
            invalid_request(py, format!("shape {shape} must be an int or a sequence of ints"))
        })?;
        let layout = Layout::contiguous(dims, itemsize).map_err(|m| invalid_request(py, m))?;
        Ok((dt, layout))
    }

    /// Raw stream handle for a call's `stream` argument: None = torch's current stream; a
    /// `torch.cuda.Stream` or a raw handle (int). Always 0 on the host.
    fn stream_handle(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let Some((current, index)) = &self.current_stream else { return Ok(0) };
        let bad = || invalid_request(py, format!(
            "stream {} is not a torch.cuda.Stream or a raw stream handle (int >= 0)",
            stream.map_or("None".to_string(), |s| s.to_string())
        ));
        match stream {
            None => call_one(py, current, index.bind(py))?.extract(),
            Some(s) => match s.extract::<u64>() {
                Ok(h) => Ok(h),
                Err(_) => s.getattr(pyo3::intern!(py, "cuda_stream")).map_err(|_| bad())?.extract().map_err(|_| bad()),
            },
        }
    }

    /// Checks out `nbytes` on `stream`; on a device out-of-memory, runs the reclaim hook and
    /// retries once.
    ///
    /// [Note: reclaim hook]
    /// The pool and torch's caching allocator draw on one device. When the device refuses the
    /// pool a block, the pool first frees its own idle blocks and retries (pool/mod.rs); if that
    /// fails too, memory the other allocator caches unused may be what is missing, and only
    /// Python can ask it back (`torch.cuda.empty_cache()`: python/zbuf/pool.py installs that on
    /// CUDA pools). The hook runs with the pool unlocked (it may free tensors whose deleters
    /// lock it) and the acquire is retried once. An exception from the hook propagates.
    fn checkout(&self, py: Python<'_>, nbytes: u64, stream: u64) -> PyResult<Lease> {
        // Bound first: the guard of a match scrutinee would live through the arms.
        let first = self.shared.lock().acquire(nbytes, stream);
        let retry = match first {
            Err(PoolError::OutOfMemory { .. }) => {
                let hook = self.reclaim_hook.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|h| h.clone_ref(py));
                match hook {
                    Some(h) => {
                        h.call1(py, (nbytes,))?;
                        true
                    }
                    None => false,
                }
            }
            _ => false,
        };
        if retry {
            let second = self.shared.lock().acquire(nbytes, stream);
            return second.map_err(to_py);
        }
        first.map_err(to_py)
    }

    fn export<'py>(&self, py: Python<'py>, shape: &Bound<'_, PyAny>, dtype: &Bound<'_, PyAny>, stream: u64, versioned: bool) -> PyResult<(Bound<'py, PyAny>, Lease)> {
        let (dtype, layout) = self.layout(py, shape, dtype)?;
        let lease = self.checkout(py, layout.nbytes, stream)?;
        let req = ExportRequest {
            shared: Arc::clone(&self.shared),
            lease: lease.id,
            ptr: lease.ptr,
            device: self.dl_device,
            dtype,
            dims: layout.dims,
        };
        Ok((dlpack::export_capsule(py, req, versioned)?, lease))
    }

    /// Whether `obj` is a torch tensor: the exact type by pointer first (the hot path), then
    /// `isinstance` for subclasses (nn.Parameter, ...).
    fn is_tensor(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
        if obj.get_type_ptr() as *mut pyo3::ffi::PyObject == self.tensor_type.as_ptr() {
            return Ok(true);
        }
        obj.is_instance(self.tensor_type.bind(py))
    }

    /// The owner key of `tensor`: its StorageImpl's address.
    fn owner_key(&self, py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<u64> {
        call_one(py, &self.storage_address, tensor)?.extract()
    }
}

#[pymethods]
impl PoolCore {
    /// Creates a pool. `device_type` is "cpu" or "cuda"; `None` sizes mean the defaults
    /// (budget = total / 32, hard cap = total / 4 of the device's memory, host RAM for "cpu").
    #[new]
    /// The arguments are checked here only (python/zbuf/pool.py passes them through).
    #[pyo3(signature = (device_type, index=0, budget_bytes=None, hard_cap_bytes=None, event_log_capacity=4096, recovery_retry_threshold=3))]
    fn new(
        py: Python<'_>,
        device_type: &str,
        index: u32,
        budget_bytes: Option<&Bound<'_, PyAny>>,
        hard_cap_bytes: Option<&Bound<'_, PyAny>>,
        event_log_capacity: i64,
        recovery_retry_threshold: i64,
    ) -> PyResult<Self> {
        let budget_bytes = budget_bytes.map(|b| byte_count(py, "budget_bytes", b)).transpose()?;
        let hard_cap_bytes = hard_cap_bytes.map(|b| byte_count(py, "hard_cap_bytes", b)).transpose()?;
        let event_log_capacity = usize::try_from(event_log_capacity)
            .map_err(|_| invalid_request(py, format!("event_log_capacity must be >= 0, got {event_log_capacity}")))?;
        let recovery_retry_threshold = u64::try_from(recovery_retry_threshold)
            .map_err(|_| invalid_request(py, format!("recovery_retry_threshold must be >= 1, got {recovery_retry_threshold}")))?;
        let kind = match device_type {
            "cpu" => DeviceKind::Host,
            "cuda" => DeviceKind::Cuda,
            other => {
                return Err(new_err(py, Class::InvalidDevice, format!("unknown device type {other:?}: use \"cpu\" or \"cuda\"")));
            }
        };
        if kind == DeviceKind::Host && index != 0 {
            return Err(new_err(py, Class::InvalidDevice, format!("the host has one device, not cpu:{index}: use \"cpu\"")));
        }
        let device = Device { kind, index };
        let mut backend = open_backend(device).map_err(to_py)?;
        let total = backend.memory_info().map(|(_, t)| t).unwrap_or(FALLBACK_HOST_TOTAL);
        let hard_cap = hard_cap_bytes.unwrap_or(total / DEFAULT_HARD_CAP_DIVISOR);
        let budget = budget_bytes.unwrap_or((total / DEFAULT_BUDGET_DIVISOR).min(hard_cap));
        if let Some(b) = budget_bytes {
            if b > hard_cap {
                return Err(invalid_request(
                    py,
                    format!("budget_bytes={b} exceeds hard_cap_bytes={hard_cap}: lower the budget or raise the hard cap"),
                ));
            }
        }
        let config = PoolConfig {
            budget_bytes: budget,
            hard_cap_bytes: hard_cap,
            event_log_capacity,
            recovery_retry_threshold,
        };
        let pool = GatherPool::new(backend, config).map_err(to_py)?;
        let torch = py.import("torch")?;
        let torch_c = py.import("torch._C")?;
        let dtypes = dlpack::TORCH_DTYPE_NAMES.iter().map(|n| torch.getattr(*n).map(Bound::unbind)).collect::<PyResult<Vec<_>>>()?;
        let current_stream = match kind {
            DeviceKind::Cuda => Some((torch_c.getattr("_cuda_getCurrentRawStream")?.unbind(), index.into_pyobject(py)?.into_any().unbind())),
            DeviceKind::Host => None,
        };
        Ok(PoolCore {
            shared: Shared::new(pool),
            device,
            dl_device: DLDevice::of(device),
            from_dlpack: torch_c.getattr("_from_dlpack")?.unbind(),
            storage_address: torch_c.getattr("_storage_address")?.unbind(),
            dtypes,
            current_stream,
            tensor_type: torch.getattr("Tensor")?.unbind(),
            reclaim_hook: Mutex::new(None),
        })
    }

    /// `(device_type, index)`.
    #[getter]
    fn device(&self) -> (&'static str, u32) {
        match self.device.kind {
            DeviceKind::Host => ("cpu", 0),
            DeviceKind::Cuda => ("cuda", self.device.index),
        }
    }

    /// acquire(shape, dtype, stream=None) -> torch.Tensor
    ///
    /// Checks out a contiguous tensor of `shape` (an int or a sequence of ints) and `dtype`
    /// backed by a pool block: zero copy, a fresh lease, contents undefined. `stream` (default:
    /// the current stream) is where it is used first; if the block was last released on
    /// another stream, that stream has been made to wait for the release on the device (no
    /// host sync). The hot path: validated, built and handed to `torch._C._from_dlpack` here.
    #[pyo3(signature = (shape, dtype, stream=None))]
    fn acquire<'py>(&self, py: Python<'py>, shape: &Bound<'py, PyAny>, dtype: &Bound<'py, PyAny>, stream: Option<&Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
        let stream = self.stream_handle(py, stream)?;
        let (capsule, lease) = self.export(py, shape, dtype, stream, true)?;
        // On failure the unconsumed capsule's destructor returns the lease.
        let tensor = call_one(py, &self.from_dlpack, &capsule)?;
        if lease.verify_holder {
            // A stale holder could name this block ([Note: stale holders]). On failure the
            // tensor dies here and its deleter returns the lease.
            let key = self.owner_key(py, &tensor)?;
            self.shared.lock().set_holder_key(lease.id, key);
        }
        Ok(tensor)
    }

    /// Checks out a block as a raw DLPack capsule ("dltensor_versioned", or the legacy
    /// "dltensor" with `versioned=False`). The lease comes back when the consumer frees the
    /// tensor, or when the capsule dies unconsumed.
    #[pyo3(signature = (shape, dtype, stream=None, versioned=true))]
    fn acquire_capsule<'py>(&self, py: Python<'py>, shape: &Bound<'py, PyAny>, dtype: &Bound<'py, PyAny>, stream: Option<&Bound<'py, PyAny>>, versioned: bool) -> PyResult<Bound<'py, PyAny>> {
        let stream = self.stream_handle(py, stream)?;
        Ok(self.export(py, shape, dtype, stream, versioned)?.0)
    }

    /// Checks out a block as a `DLPackBuffer` (the DLPack protocol object, exported once).
    #[pyo3(signature = (shape, dtype, stream=None))]
    fn acquire_buffer(&self, py: Python<'_>, shape: &Bound<'_, PyAny>, dtype: &Bound<'_, PyAny>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<DLPackBuffer> {
        let stream = self.stream_handle(py, stream)?;
        let (dtype, layout) = self.layout(py, shape, dtype)?;
        let lease = self.checkout(py, layout.nbytes, stream)?;
        Ok(DLPackBuffer::new(Arc::clone(&self.shared), self.dl_device, lease.id, lease.ptr, dtype, layout.dims, stream))
    }

    /// release(tensor, stream=None) -> None
    ///
    /// Returns `tensor`'s block to the pool now (`tensor`: what acquire returned, or any view
    /// of it), even though the tensor object lives on: it must not be used afterwards.
    /// `stream`: the last stream that used it (default: the current stream). Raises
    /// ForeignBufferError / DoubleReleaseError, leaving the pool unchanged.
    #[pyo3(signature = (tensor, stream=None))]
    fn release(&self, py: Python<'_>, tensor: &Bound<'_, PyAny>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let stream = Some(self.stream_handle(py, stream)?);
        if !self.is_tensor(py, tensor)? {
            return Err(invalid_request(py, format!(
                "release() takes a torch.Tensor from acquire(), got {}", tensor.get_type().name()?
            )));
        }
        let ptr: u64 = tensor.call_method0(pyo3::intern!(py, "data_ptr"))?.extract()?;
        let mut at = ptr;
        let mut key = None;
        // At most: the data pointer, the storage start, and each once more with the owner key.
        for _ in 0..4 {
            let outcome = self.shared.lock().release_ptr(at, key, stream);
            match outcome {
                Ok(ReleaseOutcome::Released(_)) => return Ok(()),
                // A stale holder could name the block: prove which holder this is.
                Ok(ReleaseOutcome::NeedKey) => key = Some(self.owner_key(py, tensor)?),
                // A view with an offset, or an empty tensor (data_ptr 0): try the storage's start.
                Err(PoolError::ForeignBuffer { .. }) if at == ptr => {
                    at = storage_ptr(py, tensor)?;
                    if at == ptr {
                        return Err(to_py(PoolError::ForeignBuffer { ptr }));
                    }
                }
                Err(e) => return Err(to_py(e)),
            }
        }
        unreachable!("release_ptr asks for the owner key at most once per address")
    }

    /// Whether `tensor` (or the tensor it is a view of) is checked out from this pool.
    fn owns(&self, py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<bool> {
        if !self.is_tensor(py, tensor)? {
            return Ok(false);
        }
        let key = self.owner_key(py, tensor)?;
        let base = storage_ptr(py, tensor)?;
        Ok(self.shared.lock().owns_ptr(base, key))
    }

    /// Sets (or, with None, removes) the reclaim hook: a callable taking the byte count of an
    /// acquire the device refused ([Note: reclaim hook]).
    #[pyo3(signature = (hook))]
    fn set_reclaim_hook(&self, py: Python<'_>, hook: Option<Py<PyAny>>) -> PyResult<()> {
        if let Some(h) = &hook {
            if !h.bind(py).is_callable() {
                return Err(invalid_request(py, format!("the reclaim hook must be callable (it gets the refused byte count), got {}", h.bind(py).get_type().name()?)));
            }
        }
        let old = std::mem::replace(&mut *self.reclaim_hook.lock().unwrap_or_else(|p| p.into_inner()), hook);
        drop(old); // after the std mutex is released: dropping a Python object may run Python code
        Ok(())
    }

    /// Sets the budget (clamped to the hard cap); returns the effective value.
    fn set_budget(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<u64> {
        if nbytes.is_none() {
            return Err(invalid_request(py, "set_budget() needs a number of bytes, got None".into()));
        }
        let nbytes = byte_count(py, "nbytes", nbytes)?;
        Ok(self.shared.lock().set_budget(nbytes))
    }

    /// Sets the floor the pressure policy never shrinks the budget below (clamped to the hard
    /// cap); returns the effective value. A new floor after the recovery began ends its hot-set
    /// admission.
    fn set_floor(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<u64> {
        if nbytes.is_none() {
            return Err(invalid_request(py, "set_floor() needs a number of bytes, got None".into()));
        }
        let nbytes = byte_count(py, "nbytes", nbytes)?;
        Ok(self.shared.lock().set_floor(nbytes))
    }

    /// Frees every idle block (waiting for their release events); returns the bytes freed.
    fn trim(&self, py: Python<'_>) -> u64 {
        let shared = Arc::clone(&self.shared);
        py.detach(move || shared.lock().trim())
    }

    /// Feeds allocator telemetry; returns "none", "shrink" or "recover", and the budget.
    fn observe_pressure(&self, py: Python<'_>, num_alloc_retries: &Bound<'_, PyAny>, free_bytes: &Bound<'_, PyAny>, total_bytes: &Bound<'_, PyAny>) -> PyResult<(&'static str, u64)> {
        let num_alloc_retries = byte_count(py, "num_alloc_retries", num_alloc_retries)?;
        let free_bytes = byte_count(py, "free_bytes", free_bytes)?;
        let total_bytes = byte_count(py, "total_bytes", total_bytes)?;
        if free_bytes > total_bytes {
            return Err(invalid_request(py, format!("free_bytes={free_bytes} exceeds total_bytes={total_bytes}: pass the device's values")));
        }
        let mut pool = self.shared.lock();
        let action = pool.observe_pressure(num_alloc_retries, free_bytes);
        let budget = pool.stats().budget_bytes;
        let name = match action {
            PressureAction::None => "none",
            PressureAction::Shrink { .. } => "shrink",
            PressureAction::ShrinkAndRecover { .. } => "recover",
        };
        Ok((name, budget))
    }

    /// Counters and byte totals as a dict (zbuf.pool.PoolStats wraps it).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.shared.lock().stats();
        let d = PyDict::new(py);
        d.set_item("budget_bytes", s.budget_bytes)?;
        d.set_item("hard_cap_bytes", s.hard_cap_bytes)?;
        d.set_item("floor_bytes", s.floor_bytes)?;
        d.set_item("charged_bytes", s.charged_bytes)?;
        d.set_item("idle_bytes", s.idle_bytes)?;
        d.set_item("checked_out_bytes", s.checked_out_bytes)?;
        d.set_item("outside_bytes", s.outside_bytes)?;
        d.set_item("pending_free_bytes", s.pending_free_bytes)?;
        d.set_item("high_water_bytes", s.high_water_bytes)?;
        d.set_item("high_water_total_bytes", s.high_water_total_bytes)?;
        d.set_item("entries", s.entries)?;
        d.set_item("checked_out", s.checked_out)?;
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("allocations", s.allocations)?;
        d.set_item("outside_allocations", s.outside_allocations)?;
        d.set_item("releases", s.releases)?;
        d.set_item("alloc_failures", s.alloc_failures)?;
        d.set_item("pressure_events", s.pressure_events)?;
        d.set_item("recovering", s.recovering)?;
        d.set_item("recovered", s.recovered)?;
        Ok(d)
    }

    /// Whether the events from now on carry their time (`time_us`; off by default).
    fn time_events(&self, on: bool) {
        self.shared.lock().time_events(on);
    }

    /// The retained telemetry events, oldest first, as dicts.
    fn events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events: Vec<_> = self.shared.lock().events().cloned().collect();
        let out = PyList::empty(py);
        for e in events {
            let d = PyDict::new(py);
            d.set_item("seq", e.seq)?;
            d.set_item("kind", e.kind.name())?;
            d.set_item("nbytes", e.nbytes)?;
            d.set_item("ptr", e.ptr)?;
            d.set_item("stream", e.stream)?;
            d.set_item("charged_bytes", e.charged_bytes)?;
            d.set_item("time_us", e.time_us)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// The hot set recorded by the recovery: {capacity: count}.
    fn hot_set(&self) -> Vec<(u64, u64)> {
        self.shared.lock().hot_set().iter().map(|(c, n)| (*c, *n)).collect()
    }

    /// `(free_bytes, total_bytes)` of the device, or None.
    fn memory_info(&self) -> Option<(u64, u64)> {
        self.shared.lock().backend_mut().memory_info()
    }

    /// Block capacity that serves a request of `nbytes` (alignment rounding).
    fn capacity_for(&self, nbytes: u64) -> PyResult<u64> {
        self.shared.lock().capacity_for(nbytes).map_err(to_py)
    }

    /// Benchmark hook: mean nanoseconds of `iters` acquire+release pairs of `nbytes` through
    /// the Rust core alone (lock, best fit, event record; no tensor), after one warm-up pair.
    fn _bench_core_pair(&self, py: Python<'_>, nbytes: u64, iters: u64, stream: u64) -> PyResult<f64> {
        let shared = Arc::clone(&self.shared);
        let r = py.detach(move || -> Result<f64, PoolError> {
            let warm = shared.lock().acquire(nbytes, stream)?;
            shared.lock().release(warm.id, None)?;
            let t0 = std::time::Instant::now();
            for _ in 0..iters {
                let l = shared.lock().acquire(nbytes, stream)?;
                shared.lock().release(l.id, None)?;
            }
            Ok(t0.elapsed().as_nanos() as f64 / iters.max(1) as f64)
        });
        r.map_err(to_py)
    }

    /// Testing hook: explicitly released tensors whose storage is still alive ([Note: stale
    /// holders] in pool/mod.rs).
    fn _stale_holders(&self) -> usize {
        self.shared.lock().stale_holders()
    }

    /// Testing hook: the next `count` device allocations fail with out-of-memory. Returns False
    /// if the backend cannot inject faults (CUDA).
    fn _inject_oom(&self, count: u64) -> bool {
        self.shared.lock().backend_mut().inject_oom(count)
    }
}
