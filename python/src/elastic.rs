//! `ElasticRuntime`: the binding of DeepEP V2's `ElasticBuffer` (python/deepep_kernels/elastic.py)
//! over a [`RankContext`] that owns a `kernels::elastic::ElasticBuffer`. Each dispatch and combine
//! is one call here: it raises what this buffer's kernels recorded, reads the caller's tensors
//! (the kernels crate's `elastic::checks` accept or refuse them), joins the comm stream after the
//! caller's stream or event, launches, makes every output a torch tensor on the current stream
//! and joins back (or records the event of `async_with_compute_stream`).

use crate::outputs;
use crate::{context_error, doorway, py_err, without_gil, Event, PyExchange};
use deepep_kernels::args::Arg;
use deepep_kernels::context::{self, RankContext};
use deepep_kernels::elastic::{self, checks, Counts, EpiloguePtrs, SendPtrs};
use deepep_kernels::tensor::DType;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::sync::Arc;
use std::time::Duration;

/// The handle's tensors and counts a fresh dispatch made: `(plan, topk_copy or None, psum_rank,
/// psum_expert, unaligned, recv_src_metadata, num_recv_tokens, num_expanded_tokens,
/// num_recv_tokens_per_expert_list)`.
type HandleParts = (Py<PyAny>, Option<Py<PyAny>>, Py<PyAny>, Py<PyAny>, Py<PyAny>, Py<PyAny>, usize, usize, Vec<usize>);
/// What `combine` returns: `(combined_x, combined_topk_weights or None, event)`.
type CombineResult = (Py<PyAny>, Option<Py<PyAny>>, Option<Event>);
/// What `dispatch` returns: `(recv_x, recv_sf, recv_topk_idx, recv_topk_weights, handle parts
/// (None for a cached call), event)`.
type DispatchResult = (Py<PyAny>, Option<Py<PyAny>>, Option<Py<PyAny>>, Option<Py<PyAny>>, Option<HandleParts>, Option<Event>);

fn data_ptr(t: &Bound<'_, PyAny>) -> PyResult<u64> {
    t.call_method0("data_ptr")?.extract()
}

/// One rank's V2 buffer: its own rank context (comm stream, error record, IPC buffer).
#[pyclass(module = "deepep_kernels._native")]
pub struct ElasticRuntime {
    ctx: RankContext,
}

crate::thread_safe!(ElasticRuntime);

impl ElasticRuntime {
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        context_error(py, &self.ctx).map_or(Ok(()), Err)
    }
    /// A failed step's error: what this buffer's kernels recorded, if anything, else `e`.
    fn failed(&self, py: Python<'_>, e: deepep_kernels::error::EpError) -> PyErr {
        context_error(py, &self.ctx).unwrap_or_else(|| py_err(e))
    }
    fn data_bytes(&mut self) -> PyResult<usize> {
        Ok(self.ctx.elastic_mut().map_err(py_err)?.layout().data_bytes)
    }
}

#[pymethods]
impl ElasticRuntime {
    /// Rank `rank` of `world` on CUDA device `device` (`ranks_per_gpu` ranks share it), with an
    /// IPC buffer of `num_bytes` on every rank (collective: `all_gather(bytes) -> list[bytes]`
    /// over the group). GPU waits end after `gpu_timeout_secs`, host waits after
    /// `cpu_timeout_secs` (at least the GPU bound plus a margin).
    #[new]
    #[pyo3(signature = (device, rank, world, all_gather, ranks_per_gpu, num_bytes, gpu_timeout_secs, cpu_timeout_secs))]
    #[allow(clippy::too_many_arguments)]
    fn new(py: Python<'_>, device: usize, rank: usize, world: usize, all_gather: Py<PyAny>, ranks_per_gpu: usize, num_bytes: usize, gpu_timeout_secs: f64, cpu_timeout_secs: f64) -> PyResult<ElasticRuntime> {
        if !(gpu_timeout_secs > 0.0 && cpu_timeout_secs > 0.0) {
            return Err(PyValueError::new_err(format!(
                "num_gpu_timeout_secs={gpu_timeout_secs} and num_cpu_timeout_secs={cpu_timeout_secs} must both be positive"
            )));
        }
        let trap = context::parse_trap_env(std::env::var("DEEPEP_KERNELS_TRAP_ON_ERROR").ok().as_deref()).map_err(PyValueError::new_err)?;
        let mut ctx = RankContext::new(device, rank, world, rank, world, Arc::new(PyExchange { f: all_gather }), ranks_per_gpu, trap).map_err(py_err)?;
        ctx.gpu().set_device_timeout(Duration::from_secs_f64(gpu_timeout_secs));
        if cpu_timeout_secs > ctx.gpu().host_timeout().as_secs_f64() {
            ctx.gpu().set_host_timeout(Duration::from_secs_f64(cpu_timeout_secs));
        }
        without_gil(py, || ctx.elastic_create(num_bytes)).map_err(py_err)?;
        Ok(ElasticRuntime { ctx })
    }

    /// Raw handle of the comm stream every kernel of this buffer runs on.
    fn comm_stream(&self) -> u64 {
        self.ctx.comm_stream()
    }
    /// Total bytes of this rank's buffer.
    fn num_bytes(&mut self) -> PyResult<usize> {
        Ok(self.ctx.elastic_mut().map_err(py_err)?.num_bytes())
    }
    /// SMs one rank's kernels may use: the GPU's, or this rank's share when ranks share it.
    fn num_sms(&self) -> usize {
        self.ctx.gpu().sm_count() as usize
    }

    /// A collective barrier: on the comm stream (`stream` 0) or on the raw stream `stream`;
    /// `with_cpu_sync` then waits for it on the host (bounded).
    fn barrier(&mut self, py: Python<'_>, stream: u64, with_cpu_sync: bool) -> PyResult<()> {
        self.check(py)?;
        self.ctx.bind().map_err(py_err)?;
        let r = self.ctx.elastic_mut().and_then(|b| b.barrier(stream));
        r.map_err(|e| self.failed(py, e))?;
        if with_cpu_sync {
            let ctx = &self.ctx;
            let r = without_gil(py, || {
                if stream == 0 {
                    ctx.gpu().sync("ElasticBuffer.barrier")
                } else {
                    context::Event::recorded_on(stream).and_then(|e| e.synchronize())
                }
            });
            r.map_err(|e| self.failed(py, e))?;
        }
        Ok(())
    }

    /// Release the buffer (collectively; locally after a lost peer). Later calls are refused.
    fn destroy(&mut self, py: Python<'_>) -> PyResult<()> {
        let ctx = &mut self.ctx;
        without_gil(py, || ctx.destroy()).map_err(py_err)
    }

    /// One dispatch (see `ElasticBuffer.dispatch`): `cached` is the handle's `(plan, psum_rank,
    /// psum_expert, unaligned, recv_src_metadata, do_expand, rows)`, or None for a fresh call.
    #[pyo3(signature = (x, sf, topk_idx, topk_weights, stats, cached, num_experts, max_tokens, expert_alignment, num_sms, expand, zero_padding, cpu_sync, handle_copy, tma_sf, previous_event, event_before_epilogue, async_finish, stream))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &mut self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        sf: Option<&Bound<'_, PyAny>>,
        topk_idx: &Bound<'_, PyAny>,
        topk_weights: Option<&Bound<'_, PyAny>>,
        stats: Option<&Bound<'_, PyAny>>,
        cached: Option<&Bound<'_, PyTuple>>,
        num_experts: usize,
        max_tokens: usize,
        expert_alignment: usize,
        num_sms: usize,
        expand: bool,
        zero_padding: bool,
        cpu_sync: bool,
        handle_copy: bool,
        tma_sf: bool,
        previous_event: Option<PyRef<'_, Event>>,
        event_before_epilogue: Option<PyRef<'_, Event>>,
        async_finish: bool,
        stream: u64,
    ) -> PyResult<DispatchResult> {
        self.check(py)?;
        let (r, dev) = (self.ctx.world(), self.ctx.device());
        let xa = doorway::read("x", x)?;
        let sfa = doorway::read_opt("x's scale factors", sf)?;
        let idx = doorway::read("topk_idx", topk_idx)?;
        let wa = doorway::read_opt("topk_weights", topk_weights)?;
        let sa = doorway::read_opt("cumulative_local_expert_recv_stats", stats)?;
        let cached_args: Option<([Arg; 5], bool, usize)> = match cached {
            None => None,
            Some(t) => {
                let names = ["handle's plan", "handle.psum_num_recv_tokens_per_scaleup_rank", "handle.psum_num_recv_tokens_per_expert", "handle.num_unaligned_recv_tokens_per_expert", "handle.recv_src_metadata"];
                let mut a: Vec<Arg> = Vec::with_capacity(5);
                for (i, n) in names.iter().enumerate() {
                    a.push(doorway::read(n, &t.get_item(i)?)?);
                }
                let arr: [Arg; 5] = a.try_into().expect("five");
                Some((arr, t.get_item(5)?.extract()?, t.get_item(6)?.extract()?))
            }
        };
        let req = checks::DispatchRequest {
            x: &xa,
            sf: sfa.as_ref(),
            topk_idx: &idx,
            topk_weights: wa.as_ref(),
            stats: sa.as_ref(),
            cached: cached_args.as_ref().map(|(a, e, rows)| checks::CachedHandle {
                plan: &a[0],
                psum_rank: &a[1],
                psum_expert: &a[2],
                unaligned: &a[3],
                meta: &a[4],
                expand: *e,
                recv_rows: *rows,
            }),
            num_experts,
            max_tokens,
            expert_alignment,
            num_sms,
            expand,
            zero_padding,
            cpu_sync,
        };
        let data_bytes = self.data_bytes()?;
        let plan = checks::dispatch(&req, r, data_bytes, dev).map_err(py_err)?;
        let (n, k, l) = (plan.num_tokens, plan.num_topk, plan.num_local_experts);
        self.ctx.bind().map_err(py_err)?;
        self.ctx.begin(previous_event.as_deref().map(|e| &e.inner), Some(stream)).map_err(py_err)?;

        // the handle's plan and top-k copy (fresh), or the cached handle's
        let (plan_t, copy_t) = if plan.fresh {
            let p = outputs::empty(py, DType::I32, &[checks::plan_len(n, k, r, num_experts)], dev)?;
            let c = if handle_copy { Some(outputs::empty(py, DType::I64, &[n, k], dev)?) } else { None };
            (Some(p), c)
        } else {
            (None, None)
        };
        let plan_ptr = match (&plan_t, &cached_args) {
            (Some(p), _) => data_ptr(p)?,
            (None, Some((a, _, _))) => a[0].ptr,
            (None, None) => unreachable!("a dispatch is fresh or cached"),
        };
        let ptrs = SendPtrs { plan: plan_ptr, topk_copy: copy_t.as_ref().map(data_ptr).transpose()?.unwrap_or(0) };
        let counts: Option<Counts> = {
            let buf = self.ctx.elastic_mut().map_err(py_err)?;
            let sent = without_gil(py, || buf.send(&plan, ptrs));
            sent.map_err(|e| self.failed(py, e))?
        };
        let rows = plan.output_rows(counts.as_ref());

        // outputs, on the current stream (the comm stream with allocate_on_comm_stream)
        let recv_x = outputs::empty(py, plan.x_dtype, &[rows.recv_rows, plan.hidden], dev)?;
        let (recv_sf, sf_rs, sf_ps) = match plan.sf_dtype {
            None => (None, 0, 0),
            Some(d) if tma_sf => {
                // column-major with the row count padded to 4 (16 bytes): TMA-aligned, as DeepEP
                let m4 = rows.recv_rows.div_ceil(4) * 4;
                let phys = outputs::empty(py, d, &[plan.num_sf_packs, m4], dev)?;
                let v = phys.call_method1("transpose", (0, 1))?.call_method1("narrow", (0, 0, rows.recv_rows))?;
                (Some(v), 1i64, m4 as i64)
            }
            Some(d) => (Some(outputs::empty(py, d, &[rows.recv_rows, plan.num_sf_packs], dev)?), plan.num_sf_packs as i64, 1i64),
        };
        let recv_idx = if plan.expand { None } else { Some(outputs::empty(py, DType::I64, &[rows.recv_rows, k], dev)?) };
        let recv_w = match (&wa, plan.expand) {
            (None, _) => None,
            (Some(_), true) => Some(outputs::empty(py, DType::F32, &[rows.recv_rows], dev)?),
            (Some(_), false) => Some(outputs::empty(py, DType::F32, &[rows.recv_rows, k], dev)?),
        };
        let fresh_parts = if plan.fresh {
            Some([
                outputs::empty(py, DType::I32, &[r], dev)?,
                outputs::empty(py, DType::I32, &[l], dev)?,
                outputs::empty(py, DType::I32, &[l], dev)?,
                outputs::empty(py, DType::I32, &[rows.meta_rows, k + 2], dev)?,
            ])
        } else {
            None
        };
        let [psum_rank, psum_expert, unaligned, meta] = match (&fresh_parts, &cached_args) {
            (Some(f), _) => [data_ptr(&f[0])?, data_ptr(&f[1])?, data_ptr(&f[2])?, data_ptr(&f[3])?],
            (None, Some((a, _, _))) => [a[1].ptr, a[2].ptr, a[3].ptr, a[4].ptr],
            (None, None) => unreachable!("a dispatch is fresh or cached"),
        };
        let meta_rows = match &cached_args {
            Some((a, _, _)) => a[4].shape[0],
            None => rows.meta_rows,
        };
        let out = EpiloguePtrs {
            recv_x: data_ptr(&recv_x)?,
            recv_sf: recv_sf.as_ref().map(data_ptr).transpose()?.unwrap_or(0),
            sf_row_stride: sf_rs,
            sf_pack_stride: sf_ps,
            recv_topk_idx: recv_idx.as_ref().map(data_ptr).transpose()?.unwrap_or(0),
            recv_w: recv_w.as_ref().map(data_ptr).transpose()?.unwrap_or(0),
            meta,
            psum_rank,
            psum_expert,
            unaligned,
            stats: plan.stats,
            recv_rows: rows.recv_rows,
            meta_rows,
        };
        if let Some(e) = event_before_epilogue.as_deref() {
            self.ctx.wait_event(&e.inner).map_err(py_err)?;
        }
        let r2 = self.ctx.elastic_mut().and_then(|b| b.epilogue(&plan, out));
        r2.map_err(|e| self.failed(py, e))?;
        let ev = self.ctx.end(async_finish, Some(stream)).map_err(py_err)?.map(Event::from);
        let parts = match (plan_t, fresh_parts) {
            (Some(p), Some([a, b, c, d])) => Some((
                p.unbind(),
                copy_t.map(Bound::unbind),
                a.unbind(),
                b.unbind(),
                c.unbind(),
                d.unbind(),
                rows.num_recv_tokens,
                rows.num_expanded_tokens,
                rows.per_expert_aligned,
            )),
            _ => None,
        };
        Ok((recv_x.unbind(), recv_sf.map(Bound::unbind), recv_idx.map(Bound::unbind), recv_w.map(Bound::unbind), parts, ev))
    }

    /// One combine (see `ElasticBuffer.combine`) with the handle's tensors; returns
    /// `(combined_x, combined_topk_weights or None, event)`.
    #[pyo3(signature = (x, topk_weights, bias0, bias1, meta, psum_rank, topk_idx, plan, num_experts, max_tokens, expand, allow_multiple_reduction, num_sms, previous_event, event_before_epilogue, async_finish, stream))]
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &mut self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        topk_weights: Option<&Bound<'_, PyAny>>,
        bias0: Option<&Bound<'_, PyAny>>,
        bias1: Option<&Bound<'_, PyAny>>,
        meta: &Bound<'_, PyAny>,
        psum_rank: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        plan: &Bound<'_, PyAny>,
        num_experts: usize,
        max_tokens: usize,
        expand: bool,
        allow_multiple_reduction: bool,
        num_sms: usize,
        previous_event: Option<PyRef<'_, Event>>,
        event_before_epilogue: Option<PyRef<'_, Event>>,
        async_finish: bool,
        stream: u64,
    ) -> PyResult<CombineResult> {
        self.check(py)?;
        let (r, dev) = (self.ctx.world(), self.ctx.device());
        let xa = doorway::read("x", x)?;
        let wa = doorway::read_opt("topk_weights", topk_weights)?;
        let b0 = doorway::read_opt("bias[0]", bias0)?;
        let b1 = doorway::read_opt("bias[1]", bias1)?;
        let ma = doorway::read("handle.recv_src_metadata", meta)?;
        let pa = doorway::read("handle.psum_num_recv_tokens_per_scaleup_rank", psum_rank)?;
        let ia = doorway::read("handle.topk_idx", topk_idx)?;
        let la = doorway::read("handle's plan", plan)?;
        let req = checks::CombineRequest {
            x: &xa,
            topk_weights: wa.as_ref(),
            bias: [b0.as_ref(), b1.as_ref()],
            meta: &ma,
            psum_rank: &pa,
            topk_idx: &ia,
            plan: &la,
            num_experts,
            max_tokens,
            expand,
            allow_multiple_reduction,
            num_sms,
        };
        let data_bytes = self.data_bytes()?;
        let cp = checks::combine(&req, r, data_bytes, dev).map_err(py_err)?;
        self.ctx.bind().map_err(py_err)?;
        self.ctx.begin(previous_event.as_deref().map(|e| &e.inner), Some(stream)).map_err(py_err)?;
        let out = outputs::empty(py, DType::Bf16, &[cp.num_tokens, cp.hidden], dev)?;
        let out_w = if wa.is_some() { Some(outputs::empty(py, DType::F32, &[cp.num_tokens, cp.num_topk], dev)?) } else { None };
        if let Some(e) = event_before_epilogue.as_deref() {
            // the reduce is launched right after the push; the wait orders both after the event
            self.ctx.wait_event(&e.inner).map_err(py_err)?;
        }
        let (o, ow) = (data_ptr(&out)?, out_w.as_ref().map(data_ptr).transpose()?.unwrap_or(0));
        let res = self.ctx.elastic_mut().and_then(|b| b.combine(&cp, o, ow));
        res.map_err(|e| self.failed(py, e))?;
        let ev = self.ctx.end(async_finish, Some(stream)).map_err(py_err)?.map(Event::from);
        Ok((out.unbind(), out_w.map(Bound::unbind), ev))
    }
}

/// `ElasticBuffer.get_buffer_size_hint` for `num_ranks` ranks (no group needed): bytes per
/// rank, a multiple of 2 MiB.
#[pyfunction]
#[pyo3(signature = (num_ranks, num_max_tokens_per_rank, hidden, num_topk = 0, use_fp8_dispatch = false))]
pub(crate) fn elastic_buffer_size_hint(num_ranks: usize, num_max_tokens_per_rank: usize, hidden: usize, num_topk: usize, use_fp8_dispatch: bool) -> PyResult<usize> {
    elastic::size_hint(num_ranks, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch).map_err(py_err)
}
