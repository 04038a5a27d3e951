//! Where a model runs and in which dtype, as config files and `--device` / `--dtype` flags
//! spell them: [`DeviceSpec`] (`cpu`, `cuda`, `cuda:N`) and [`Dtype`] (`f32`, `bf16`, `f16`).
//! Both parse once, serialize back to the same spelling, and give candle's types.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device};

/// `cpu`, `cuda` (= `cuda:0`) or `cuda:N`. CUDA needs a build with `--features cuda`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The CPU.
    #[default]
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl DeviceSpec {
    /// Opens the device (a one-line error when CUDA is not built in or the ordinal is absent).
    pub fn device(self) -> Result<Device, String> {
        let first = |e: candle_core::Error| e.to_string().lines().next().unwrap_or("").to_string();
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(n) => {
                let d = Device::new_cuda(n).map_err(first)?;
                without_event_tracking(&d);
                #[cfg(feature = "cuda")]
                if let Device::Cuda(cd) = &d {
                    grpo_core::cuda::keep_pool_across_syncs(cd);
                }
                Ok(d)
            }
        }
    }
}

/// Turns off cudarc's event tracking for the device's context: by default every CUDA
/// allocation creates two events and every free destroys them (four driver calls per candle
/// op), to order uses between streams that cudarc created (`new_stream`, `fork`: its
/// "multi-stream mode"). candle's `Device::new_cuda` runs each thread on its own per-thread
/// default stream and neither candle nor this project creates a stream, so the events are
/// never used; hand-overs between threads are synchronised explicitly (the learner's
/// `publish`). A decode step is bound by this host work (≈ 240 ops per step on the 0.77B
/// model). `GRPO_CUDA_EVENTS=1` keeps the tracking.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn without_event_tracking(d: &Device) {
    if std::env::var("GRPO_CUDA_EVENTS").is_ok_and(|v| v == "1") {
        return;
    }
    if let Device::Cuda(cd) = d {
        // SAFETY: cudarc's contract for turning tracking off is that the caller orders uses
        // across streams itself; no stream of cudarc's multi-stream mode exists here (see
        // above), and slices made before this call keep their events.
        unsafe { cd.cuda_stream().context().disable_event_tracking() };
    }
}

#[cfg(not(feature = "cuda"))]
fn without_event_tracking(_: &Device) {}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("expected cpu, cuda or cuda:N, got `{other}`")),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A model's floating-point type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dtype {
    /// 32-bit floats (the default).
    #[default]
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
}

impl Dtype {
    /// candle's dtype.
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }

    /// The short name (`f32`, `bf16`, `f16`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }
}

impl FromStr for Dtype {
    type Err = String;

    /// The short names and torch's long ones (`float32`, `bfloat16`, `float16`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "f16" | "float16" => Ok(Self::F16),
            other => Err(format!("expected f32, bf16 or f16, got `{other}`")),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

macro_rules! serde_via_str {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
serde_via_str!(DeviceSpec);
serde_via_str!(Dtype);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_ones_are_refused() {
        for (s, d) in [("cpu", DeviceSpec::Cpu), ("cuda:3", DeviceSpec::Cuda(3))] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap(), d);
            assert_eq!(d.to_string(), s);
        }
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert!("tpu".parse::<DeviceSpec>().unwrap_err().contains("`tpu`"));
        assert!("cuda:x".parse::<DeviceSpec>().is_err());
        assert_eq!("bfloat16".parse::<Dtype>().unwrap(), Dtype::Bf16);
        assert_eq!(Dtype::F16.dtype(), DType::F16);
        let e = "f8".parse::<Dtype>().unwrap_err();
        assert!(e.contains("expected f32, bf16 or f16"), "{e}");
        let j = serde_json::to_string(&(DeviceSpec::Cuda(1), Dtype::Bf16)).unwrap();
        assert_eq!(j, r#"["cuda:1","bf16"]"#);
        let back: (DeviceSpec, Dtype) = serde_json::from_str(&j).unwrap();
        assert_eq!(back, (DeviceSpec::Cuda(1), Dtype::Bf16));
    }
}
