//! The libtorch learner (CUDA when present).
//!
//! - [`objective`]: decoupled PPO with capped off-policy weights, A-3PO
//!   approximate proximal log-probs, `ppo` / `adaptive` / `m2po` clipping;
//!   [`advantages`]: GRPO group normalisation.
//! - [`batch`]: the buffer's Arrow groups as right-padded tensors.
//! - [`engine`]: the trainer-engine boundary; [`trainer`] is the built-in
//!   engine (one step on the thread that owns the model, [`actor`], with
//!   [`adamw`] and [`checkpoint`]s), [`torch_engine`] drives the PyTorch
//!   one (`trainer/`, FSDP2) over gRPC.
//! - [`service`]: the role: knobs, batches (the next one fetched while a
//!   step trains), weight publication (uploaded while the next step
//!   trains), resume; [`pending`]: the batches it holds until their
//!   versions are announced.
//! - [`eval`]: held-out evaluation (`[eval]`, `asyncrl eval`).
//! - [`outputs`]: the run's files (`trained.jsonl`, `learner_metrics.csv`,
//!   `eval.csv`) as typed records, with their writers and readers.
//! - [`sft`]: the supervised warm start of the built-in model.
//! - [`device_report`]: what libtorch the process linked and what it sees.

pub mod actor;
pub mod adamw;
pub mod advantages;
pub mod batch;
pub mod checkpoint;
pub mod engine;
pub mod eval;
pub mod metrics;
pub mod objective;
pub mod outputs;
pub mod pending;
pub mod service;
pub mod sft;
pub mod shared;
pub mod torch_engine;
pub mod trainer;

use std::fmt;

use tch::{Cuda, Device, Kind, Tensor};

/// The version of the `tch` crate this learner is built on (the Cargo.toml
/// requirement; `tch` exposes no version constant).
pub const TCH_VERSION: &str = "0.24";

/// What libtorch this process linked and which accelerators it sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceReport {
    /// Version of the libtorch the binary was built against (e.g. `2.11.0+cu130`).
    pub libtorch_version: String,
    /// Directory of libtorch's shared libraries, as found at build time.
    pub libtorch_lib_dir: String,
    /// The CUDA version this libtorch was built for (`13.0`); None for a
    /// CPU-only build.
    pub built_for_cuda: Option<String>,
    /// Whether a CUDA device is usable right now.
    pub cuda_available: bool,
    pub cuda_device_count: i64,
    pub cudnn_available: bool,
    /// cuDNN version as libtorch reports it (e.g. 91002), when cuDNN is usable.
    pub cudnn_version: Option<i64>,
    /// Threads libtorch uses for intra-op parallelism on the CPU.
    pub cpu_threads: i32,
}

/// Asks the linked libtorch what it was built with and what it sees.
pub fn device_report() -> DeviceReport {
    let cuda_available = Cuda::is_available();
    let cudnn_available = cuda_available && Cuda::cudnn_is_available();
    DeviceReport {
        libtorch_version: env!("ASYNCRL_LIBTORCH_VERSION").to_owned(),
        libtorch_lib_dir: env!("ASYNCRL_LIBTORCH_LIB").to_owned(),
        built_for_cuda: Some(env!("ASYNCRL_LIBTORCH_CUDA"))
            .filter(|v| !v.is_empty())
            .map(str::to_owned),
        cuda_available,
        cuda_device_count: if cuda_available {
            Cuda::device_count()
        } else {
            0
        },
        cudnn_available,
        cudnn_version: cudnn_available.then(tch::utils::version_cudnn),
        cpu_threads: tch::utils::get_num_threads(),
    }
}

impl DeviceReport {
    /// The device a learner would train on: the first CUDA device if there is
    /// one, else the CPU.
    pub fn preferred_device(&self) -> Device {
        if self.cuda_available {
            Device::Cuda(0)
        } else {
            Device::Cpu
        }
    }
}

impl fmt::Display for DeviceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "libtorch {} (tch {TCH_VERSION}, {}) from {}",
            self.libtorch_version,
            match &self.built_for_cuda {
                Some(v) => format!("built for CUDA {v}"),
                None => "CPU-only build".to_owned(),
            },
            self.libtorch_lib_dir
        )?;
        write!(
            f,
            "CUDA available: {}, devices: {}, cuDNN: {}",
            yes_no(self.cuda_available),
            self.cuda_device_count,
            match self.cudnn_version {
                Some(v) => format!("yes ({v})"),
                None => "no".to_owned(),
            }
        )?;
        write!(f, "\nCPU threads: {}", self.cpu_threads)
    }
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// A tiny computation on `device` whose result is known: `sum(2·x + 1)` for
/// `x = [1, 2, 3, 4]` and a 2×2 matmul. Returns the two results, so a caller
/// (test, smoke check) can see that libtorch actually ran on that device.
pub fn smoke_compute(device: Device) -> Result<(f64, Vec<f32>), tch::TchError> {
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).to_device(device);
    let affine = (&x * 2.0 + 1.0).sum(Kind::Float);
    let m = x.reshape([2, 2]);
    let product = m.matmul(&m).to_device(Device::Cpu).reshape([-1]);
    Ok((
        f64::try_from(affine.to_device(Device::Cpu))?,
        Vec::<f32>::try_from(product)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_is_consistent() {
        let r = device_report();
        assert!(
            r.libtorch_version.starts_with("2."),
            "{}",
            r.libtorch_version
        );
        assert_eq!(r.cuda_available, r.cuda_device_count > 0);
        assert!(r.cpu_threads >= 1);
        let text = r.to_string();
        assert!(text.contains("libtorch 2."), "{text}");
        assert!(text.contains("CUDA available:"), "{text}");
    }

    #[test]
    fn tensor_arithmetic_on_every_device() {
        let r = device_report();
        let mut devices = vec![Device::Cpu];
        devices.extend((0..r.cuda_device_count).map(|i| Device::Cuda(i as usize)));
        for device in devices {
            let (sum, product) = smoke_compute(device).expect("libtorch computation");
            // 2·(1+2+3+4) + 4·1
            assert_eq!(sum, 24.0, "on {device:?}");
            // [[1,2],[3,4]]² = [[7,10],[15,22]]
            assert_eq!(product, vec![7.0, 10.0, 15.0, 22.0], "on {device:?}");
        }
    }
}
