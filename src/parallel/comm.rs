//! The collectives a tensor-parallel group needs ([`Communicator`]) and an
//! in-process reference implementation over threads ([`LocalGroup`]).
//!
//! A collective is entered by every rank of the group, in the same order,
//! with tensors of one shape and dtype (NCCL's contract). A rank that fails
//! outside a collective calls [`Communicator::abort`]: every rank waiting
//! in a collective, or entering one later, returns an error naming the
//! failure, until [`Communicator::reset`] once every rank has left the
//! failed step. A collective that waits longer than the group's timeout
//! fails the same way, so a lost rank never hangs the others.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{bail, DType, Result, Tensor};

const OP: &str = "tensor-parallel";

/// The collectives of one rank of a tensor-parallel group.
///
/// Implementations: [`LocalGroup`] (threads of one process, the reference);
/// an NCCL one (one process or thread per GPU) can implement the same
/// trait.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This rank, `< world_size()`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn world_size(&self) -> usize;

    /// The element-wise sum of every rank's `t`; every rank gets the same
    /// tensor, on its own `t`'s device, in `t`'s dtype.
    ///
    /// # Arguments
    /// * `t` - any shape; every rank passes the same shape and dtype.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;

    /// Every rank's `t` concatenated along `dim`, in rank order; every
    /// rank gets the same tensor, on its own `t`'s device.
    ///
    /// # Arguments
    /// * `t` - any shape; every rank passes the same shape and dtype.
    /// * `dim` - the dimension to concatenate along, `< t.rank()`.
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor>;

    /// Marks the group's current step failed, because of `reason`: every
    /// rank waiting in a collective, or entering one, returns an error
    /// naming it until [`reset`](Self::reset).
    fn abort(&self, reason: &str);

    /// Why the group's current step failed (the first abort, or the first
    /// collective that timed out), until [`reset`](Self::reset); `None`
    /// while it has not failed.
    fn failure(&self) -> Option<String>;

    /// Clears a failure and any half-finished collective so that the next
    /// step starts clean. Call it once, when no rank is inside a collective
    /// (after every rank has returned from the failed step).
    fn reset(&self) -> Result<()>;
}

/// Which collective a rank entered, with what: every rank of one
/// collective must agree.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Call {
    kind: &'static str,
    dim: usize,
    dims: Vec<usize>,
    dtype: DType,
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of {:?} {:?}", self.kind, self.dims, self.dtype)?;
        if self.kind == "all_gather" {
            write!(f, " along dim {}", self.dim)?;
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
struct State {
    /// Each rank's input to the current collective.
    slots: Vec<Option<Tensor>>,
    /// The current collective, as the first rank in entered it.
    call: Option<Call>,
    arrived: usize,
    /// The current collective's result, once every rank arrived.
    result: Option<Tensor>,
    /// Ranks that took the result.
    taken: usize,
    /// Collectives completed since the group was built (for messages).
    completed: u64,
    failure: Option<String>,
}

#[derive(Debug)]
struct Shared {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

/// One rank of an in-process group: the reference [`Communicator`] for
/// ranks running on threads of one process.
///
/// Inputs meet in shared slots under a mutex; the last rank to arrive
/// computes the result and every rank takes a copy (on its own device).
/// Sums run over ranks `0..world_size` in order, accumulated in f32 and
/// rounded once to the inputs' dtype, so results are reproducible and the
/// same on every rank. A rank that waits longer than the timeout in a
/// collective fails it, and the group, for every rank.
#[derive(Clone, Debug)]
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// A collective's default timeout.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// The `world_size` ranks of a new group, in rank order; a collective
    /// that waits more than `timeout` for the others fails the group.
    pub fn new(world_size: usize, timeout: Duration) -> Result<Vec<Self>> {
        if world_size == 0 {
            bail!("{OP}: world_size must be at least 1, got 0");
        }
        if timeout.is_zero() {
            bail!("{OP}: the collective timeout must be positive, got {timeout:?}");
        }
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            state: Mutex::new(State {
                slots: vec![None; world_size],
                ..Default::default()
            }),
            changed: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| Self {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }

    /// The timeout of a collective.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        // A rank that panicked while holding the lock failed the group.
        self.shared
            .state
            .lock()
            .map_err(|_| candle_core::Error::msg(format!("{OP}: a rank panicked in a collective")))
    }

    /// Fails the group (when it has not failed yet) with `reason` and
    /// wakes every rank.
    fn fail(&self, st: &mut State, reason: String) -> candle_core::Error {
        let reason = st.failure.get_or_insert(reason).clone();
        self.shared.changed.notify_all();
        candle_core::Error::msg(format!("{OP}: rank {}: {reason}", self.rank))
    }

    /// Waits for a change of the state until `deadline`; `what` says what
    /// the rank waits for, for the timeout's message.
    fn wait<'a>(
        &self,
        st: MutexGuard<'a, State>,
        deadline: Instant,
        what: &dyn Fn(&State) -> String,
    ) -> Result<MutexGuard<'a, State>> {
        let left = deadline.saturating_duration_since(Instant::now());
        let (mut st, timeout) = self.shared.changed.wait_timeout(st, left).map_err(|_| {
            candle_core::Error::msg(format!("{OP}: a rank panicked in a collective"))
        })?;
        if timeout.timed_out() && Instant::now() >= deadline && st.failure.is_none() {
            let reason = format!(
                "rank {} timed out after {:?} waiting for {}",
                self.rank,
                self.shared.timeout,
                what(&st)
            );
            return Err(self.fail(&mut st, reason));
        }
        Ok(st)
    }

    /// Enters collective `call` with `t`; the last rank to arrive runs
    /// `combine` over the inputs in rank order.
    fn collective(
        &self,
        call: Call,
        t: &Tensor,
        combine: impl FnOnce(&[Tensor]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let n = self.shared.world_size;
        let deadline = Instant::now() + self.shared.timeout;
        let mut st = self.lock()?;
        // Wait until every rank took the previous collective's result.
        loop {
            if let Some(f) = &st.failure {
                bail!("{OP}: rank {}: the group failed: {f}", self.rank);
            }
            if st.result.is_none() {
                break;
            }
            st = self.wait(st, deadline, &|s| {
                format!("the ranks to take collective {}'s result", s.completed)
            })?;
        }
        match &st.call {
            None => st.call = Some(call.clone()),
            Some(first) if *first != call => {
                let reason = format!(
                    "collective {} mismatch: rank {} entered {call}, another rank {first}",
                    st.completed, self.rank
                );
                return Err(self.fail(&mut st, reason));
            }
            Some(_) => {}
        }
        if st.slots[self.rank].is_some() {
            let reason = format!(
                "rank {} entered collective {} twice",
                self.rank, st.completed
            );
            return Err(self.fail(&mut st, reason));
        }
        st.slots[self.rank] = Some(t.clone());
        st.arrived += 1;
        if st.arrived == n {
            let inputs: Vec<Tensor> = st.slots.iter().flatten().cloned().collect();
            match combine(&inputs) {
                Ok(r) => st.result = Some(r),
                Err(e) => {
                    let reason = format!("{call} failed: {e}");
                    return Err(self.fail(&mut st, reason));
                }
            }
            self.shared.changed.notify_all();
        } else {
            while st.result.is_none() {
                if let Some(f) = &st.failure {
                    bail!("{OP}: rank {}: the group failed: {f}", self.rank);
                }
                st = self.wait(st, deadline, &|s| {
                    let missing: Vec<usize> = (0..n).filter(|&r| s.slots[r].is_none()).collect();
                    format!("ranks {missing:?} in collective {} ({call})", s.completed)
                })?;
            }
        }
        let Some(result) = st.result.clone() else {
            bail!("{OP}: rank {}: collective without a result", self.rank);
        };
        st.taken += 1;
        if st.taken == n {
            st.slots.iter_mut().for_each(|s| *s = None);
            st.call = None;
            st.arrived = 0;
            st.taken = 0;
            st.result = None;
            st.completed += 1;
            self.shared.changed.notify_all();
        }
        drop(st);
        result.to_device(t.device())
    }
}

impl Communicator for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let call = Call {
            kind: "all_reduce_sum",
            dim: 0,
            dims: t.dims().to_vec(),
            dtype: t.dtype(),
        };
        if self.shared.world_size == 1 {
            return Ok(t.clone());
        }
        self.collective(call, t, |inputs| {
            let dtype = inputs[0].dtype();
            let device = inputs[0].device();
            let mut acc = inputs[0].to_dtype(DType::F32)?;
            for x in &inputs[1..] {
                acc = (acc + x.to_device(device)?.to_dtype(DType::F32)?)?;
            }
            acc.to_dtype(dtype)
        })
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        if dim >= t.rank() {
            bail!(
                "{OP}: all_gather along dim {dim} of a tensor of shape {:?}",
                t.dims()
            );
        }
        let call = Call {
            kind: "all_gather",
            dim,
            dims: t.dims().to_vec(),
            dtype: t.dtype(),
        };
        if self.shared.world_size == 1 {
            return Ok(t.clone());
        }
        self.collective(call, t, |inputs| {
            let device = inputs[0].device();
            let parts = inputs
                .iter()
                .map(|x| x.to_device(device))
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&parts, dim)
        })
    }

    fn abort(&self, reason: &str) {
        // A poisoned lock already fails every collective.
        if let Ok(mut st) = self.shared.state.lock() {
            self.fail(&mut st, reason.to_string());
        }
    }

    fn failure(&self) -> Option<String> {
        match self.shared.state.lock() {
            Ok(st) => st.failure.clone(),
            Err(_) => Some("a rank panicked in a collective".to_string()),
        }
    }

    fn reset(&self) -> Result<()> {
        let mut st = self.lock()?;
        let completed = st.completed;
        *st = State {
            slots: vec![None; self.shared.world_size],
            completed,
            ..Default::default()
        };
        self.shared.changed.notify_all();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// Runs `f(rank's communicator)` on one thread per rank.
    fn on_ranks<T: Send>(
        group: &[LocalGroup],
        f: impl Fn(&LocalGroup) -> Result<T> + Sync,
    ) -> Vec<Result<T>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = group.iter().map(|c| s.spawn(|| f(c))).collect();
            handles
                .into_iter()
                // Test code: a panicking rank thread is the test failing.
                .map(|h| h.join().expect("rank thread"))
                .collect()
        })
    }

    #[test]
    fn all_reduce_sums_in_rank_order_and_all_gather_concatenates() -> Result<()> {
        let dev = Device::Cpu;
        for n in [1, 2, 3, 4] {
            let group = LocalGroup::new(n, Duration::from_secs(10))?;
            let input = |r: usize| Tensor::new(&[[r as f32, 1.0], [0.5, -(r as f32)]], &dev);
            // Several collectives in a row on the same group.
            let out = on_ranks(&group, |c| {
                let mut sums = Vec::new();
                for k in 0..3 {
                    let x = (input(c.rank())? * (k + 1) as f64)?;
                    sums.push(c.all_reduce_sum(&x)?.to_vec2::<f32>()?);
                }
                let g = c.all_gather(&input(c.rank())?, 1)?;
                Ok((sums, g.to_vec2::<f32>()?))
            });
            let total: f32 = (0..n).map(|r| r as f32).sum();
            for r in out {
                let (sums, gathered) = r?;
                for (k, s) in sums.iter().enumerate() {
                    let m = (k + 1) as f32;
                    let want = vec![
                        vec![m * total, m * n as f32],
                        vec![m * 0.5 * n as f32, -m * total],
                    ];
                    assert_eq!(s, &want);
                }
                let row0: Vec<f32> = (0..n).flat_map(|r| [r as f32, 1.0]).collect();
                assert_eq!(gathered[0], row0);
            }
        }
        Ok(())
    }

    #[test]
    fn a_bf16_sum_is_accumulated_in_f32_and_the_same_on_every_rank() -> Result<()> {
        let dev = Device::Cpu;
        let group = LocalGroup::new(4, Duration::from_secs(10))?;
        // 256 + 1 + 1 + 1 = 259, rounded once to bf16 (steps of 2 at 256):
        // 260. Summed in bf16 one rank at a time, each 1 would be lost (256).
        let out = on_ranks(&group, |c| {
            let v = if c.rank() == 0 { 256f32 } else { 1.0 };
            let x = Tensor::new(&[v], &dev)?.to_dtype(DType::BF16)?;
            c.all_reduce_sum(&x)?.to_dtype(DType::F32)?.to_vec1::<f32>()
        });
        for r in out {
            assert_eq!(r?, [260.0]);
        }
        Ok(())
    }

    #[test]
    fn a_missing_rank_times_out_every_waiting_rank() -> Result<()> {
        let dev = Device::Cpu;
        let group = LocalGroup::new(3, Duration::from_millis(200))?;
        let start = Instant::now();
        // Rank 2 never enters the collective.
        let out = on_ranks(&group, |c| {
            if c.rank() == 2 {
                return Ok(None);
            }
            c.all_reduce_sum(&Tensor::new(&[1f32], &dev)?).map(Some)
        });
        assert!(start.elapsed() < Duration::from_secs(5));
        for (r, res) in out.into_iter().enumerate().take(2) {
            let err = res.unwrap_err().to_string();
            assert!(
                err.contains("timed out after 200ms waiting for ranks [2]"),
                "rank {r}: {err}"
            );
        }
        // The late rank fails at once too; after a reset the group works.
        let late = group[2].all_reduce_sum(&Tensor::new(&[1f32], &dev)?);
        assert!(late.unwrap_err().to_string().contains("the group failed"));
        // Test code: the collective above failed, so a failure is recorded.
        let why = group[2].failure().expect("a failure");
        assert!(
            why.contains("timed out after 200ms waiting for ranks [2]"),
            "{why}"
        );
        group[0].reset()?;
        assert_eq!(group[2].failure(), None);
        let out = on_ranks(&group, |c| {
            c.all_reduce_sum(&Tensor::new(&[2f32], &dev)?)?
                .to_vec1::<f32>()
        });
        for r in out {
            assert_eq!(r?, [6.0]);
        }
        Ok(())
    }

    #[test]
    fn an_abort_fails_every_rank_with_its_reason() -> Result<()> {
        let dev = Device::Cpu;
        let group = LocalGroup::new(4, Duration::from_secs(30))?;
        let start = Instant::now();
        let out = on_ranks(&group, |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(50));
                c.abort("rank 1: injected failure");
                bail!("rank 1 failed");
            }
            c.all_reduce_sum(&Tensor::new(&[1f32], &dev)?)
        });
        // Well before the 30 s timeout.
        assert!(start.elapsed() < Duration::from_secs(5));
        for (r, res) in out.into_iter().enumerate() {
            let err = res.unwrap_err().to_string();
            if r != 1 {
                assert!(err.contains("rank 1: injected failure"), "rank {r}: {err}");
            }
        }
        assert_eq!(
            group[3].failure().as_deref(),
            Some("rank 1: injected failure")
        );
        Ok(())
    }

    #[test]
    fn mismatched_collectives_fail_the_group() -> Result<()> {
        let dev = Device::Cpu;
        let group = LocalGroup::new(2, Duration::from_secs(30))?;
        let out = on_ranks(&group, |c| {
            let x = Tensor::zeros((2, c.rank() + 1), DType::F32, &dev)?;
            c.all_reduce_sum(&x)
        });
        for res in out {
            let err = res.unwrap_err().to_string();
            assert!(err.contains("mismatch"), "{err}");
        }
        let err = group[0]
            .all_gather(&Tensor::zeros(3, DType::F32, &dev)?, 1)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("along dim 1 of a tensor of shape [3]"),
            "{err}"
        );
        assert!(LocalGroup::new(0, Duration::from_secs(1)).is_err());
        assert!(LocalGroup::new(2, Duration::ZERO).is_err());
        Ok(())
    }
}
