//! CPU tests of the intranode argument checks (no GPU): every bad input is rejected before any
//! launch with a message that names the problem and the fix; good inputs produce the launch plan.

use deepep_kernels::config::{BufferLayout, Config};
use deepep_kernels::intranode::checks::{self, HandleInfo, RoutingInfo};
use deepep_kernels::tensor::{DType, TensorInfo};

const BUF: u64 = 7;
const BASE: u64 = 0x7f00_0000_0000;

fn t(dtype: DType, shape: &[usize]) -> TensorInfo {
    TensorInfo::contiguous(dtype, shape, BASE)
}

fn layout() -> BufferLayout {
    BufferLayout::new(2, 4096, 7168).unwrap()
}

fn fresh<'a>(idx: &'a TensorInfo, w: &'a TensorInfo, n: usize, e: usize) -> RoutingInfo<'a> {
    RoutingInfo::Fresh { layout_tokens: n, num_experts: e, topk_idx: idx, topk_weights: w, expert_alignment: 1 }
}

fn dispatch_err(x: &TensorInfo, scales: Option<&TensorInfo>, routing: &RoutingInfo<'_>, cfg: &Config) -> String {
    checks::check_dispatch(&layout(), BUF, x, scales, routing, cfg, Some(132)).unwrap_err().to_string()
}

#[test]
fn good_bf16_fresh_dispatch_gives_the_plan() {
    let (x, idx, w) = (t(DType::Bf16, &[4096, 7168]), t(DType::I64, &[4096, 8]), t(DType::F32, &[4096, 8]));
    let p = checks::check_dispatch(&layout(), BUF, &x, None, &fresh(&idx, &w, 4096, 256), &Config::default(), Some(132)).unwrap();
    assert_eq!((p.num_tokens, p.hidden, p.row_bytes, p.num_scales, p.num_topk, p.num_experts), (4096, 7168, 14336, 0, 8, 256));
}

#[test]
fn good_fp8_dispatch_accepts_row_and_column_major_scales() {
    let (x, idx, w) = (t(DType::Fp8E4m3, &[100, 4096]), t(DType::I64, &[100, 6]), t(DType::F32, &[100, 6]));
    let rm = t(DType::F32, &[100, 32]);
    let p = checks::check_dispatch(&layout(), BUF, &x, Some(&rm), &fresh(&idx, &w, 100, 64), &Config::default(), None).unwrap();
    assert_eq!((p.row_bytes, p.num_scales, p.scale_row_stride, p.scale_col_stride), (4096, 32, 32, 1));
    // Column-major: physical [32, 100], viewed as [100, 32] with strides (1, 100).
    let cm = TensorInfo { dtype: DType::F32, shape: vec![100, 32], strides: vec![1, 100], ptr: BASE };
    let p = checks::check_dispatch(&layout(), BUF, &x, Some(&cm), &fresh(&idx, &w, 100, 64), &Config::default(), None).unwrap();
    assert_eq!((p.scale_row_stride, p.scale_col_stride), (1, 100));
}

#[test]
fn dispatch_rejects_wrong_dtype_shape_and_capacity() {
    let (idx, w) = (t(DType::I64, &[16, 8]), t(DType::F32, &[16, 8]));
    let r = fresh(&idx, &w, 16, 256);
    let e = dispatch_err(&t(DType::F32, &[16, 7168]), None, &r, &Config::default());
    assert!(e.contains("dtype f32") && e.contains("bf16"), "{e}");
    let e = dispatch_err(&t(DType::Bf16, &[16, 7004]), None, &r, &Config::default());
    assert!(e.contains("multiple of"), "{e}");
    let e = dispatch_err(&t(DType::Bf16, &[16, 8192]), None, &r, &Config::default());
    assert!(e.contains("hidden <= 7168") && e.contains("create the Buffer"), "{e}");
    let (idx2, w2) = (t(DType::I64, &[5000, 8]), t(DType::F32, &[5000, 8]));
    let e = dispatch_err(&t(DType::Bf16, &[5000, 7168]), None, &fresh(&idx2, &w2, 5000, 256), &Config::default());
    assert!(e.contains("5000 tokens exceed the capacity of 4096"), "{e}");
    let e = dispatch_err(&t(DType::Bf16, &[16]), None, &r, &Config::default());
    assert!(e.contains("2-D"), "{e}");
    let strided = TensorInfo { dtype: DType::Bf16, shape: vec![16, 7168], strides: vec![8192, 1], ptr: BASE };
    let e = dispatch_err(&strided, None, &r, &Config::default());
    assert!(e.contains("not contiguous"), "{e}");
    let misaligned = TensorInfo::contiguous(DType::Bf16, &[16, 7168], BASE + 8);
    let e = dispatch_err(&misaligned, None, &r, &Config::default());
    assert!(e.contains("16-byte aligned"), "{e}");
}

#[test]
fn dispatch_checks_scales_against_dtype() {
    let (idx, w) = (t(DType::I64, &[16, 8]), t(DType::F32, &[16, 8]));
    let r = fresh(&idx, &w, 16, 256);
    let e = dispatch_err(&t(DType::Fp8E4m3, &[16, 7168]), None, &r, &Config::default());
    assert!(e.contains("no scales"), "{e}");
    let s = t(DType::F32, &[16, 56]);
    let e = dispatch_err(&t(DType::Bf16, &[16, 7168]), Some(&s), &r, &Config::default());
    assert!(e.contains("bf16 x"), "{e}");
    let bad = t(DType::F32, &[16, 55]);
    let e = dispatch_err(&t(DType::Fp8E4m3, &[16, 7168]), Some(&bad), &r, &Config::default());
    assert!(e.contains("[16, 56]"), "{e}");
    let e = dispatch_err(&t(DType::Fp8E4m3, &[16, 2112]), Some(&t(DType::F32, &[16, 16])), &r, &Config::default());
    assert!(e.contains("multiple of 128"), "{e}");
}

#[test]
fn dispatch_checks_routing() {
    let x = t(DType::Bf16, &[16, 2048]);
    let (idx, w) = (t(DType::I64, &[16, 8]), t(DType::F32, &[16, 8]));
    let e = dispatch_err(&x, None, &fresh(&idx, &w, 17, 256), &Config::default());
    assert!(e.contains("dispatch_layout"), "{e}");
    let e = dispatch_err(&x, None, &fresh(&idx, &w, 16, 255), &Config::default());
    assert!(e.contains("cannot be split evenly"), "{e}");
    let (idx33, w33) = (t(DType::I64, &[16, 33]), t(DType::F32, &[16, 33]));
    let e = dispatch_err(&x, None, &fresh(&idx33, &w33, 16, 256), &Config::default());
    assert!(e.contains("top-k 33"), "{e}");
    let idx32 = t(DType::I32, &[16, 8]);
    let e = dispatch_err(&x, None, &fresh(&idx32, &w, 16, 256), &Config::default());
    assert!(e.contains("topk_idx has dtype i32"), "{e}");
    let w6 = t(DType::F32, &[16, 6]);
    let e = dispatch_err(&x, None, &fresh(&idx, &w6, 16, 256), &Config::default());
    assert!(e.contains("topk_weights") && e.contains("[16, 8]"), "{e}");
    let e = dispatch_err(&x, None, &fresh(&idx, &w, 16, 4096), &Config::default());
    assert!(e.contains("2048 local experts"), "{e}");
    let mut r = fresh(&idx, &w, 16, 256);
    if let RoutingInfo::Fresh { expert_alignment, .. } = &mut r {
        *expert_alignment = 0;
    }
    let e = dispatch_err(&x, None, &r, &Config::default());
    assert!(e.contains("expert_alignment"), "{e}");
}

#[test]
fn cached_dispatch_needs_this_buffers_handle_and_same_tokens() {
    let x = t(DType::Bf16, &[16, 2048]);
    let e = dispatch_err(&x, None, &RoutingInfo::Cached { handle_buffer: BUF + 1, handle_tokens: 16 }, &Config::default());
    assert!(e.contains("different Buffer"), "{e}");
    let e = dispatch_err(&x, None, &RoutingInfo::Cached { handle_buffer: BUF, handle_tokens: 15 }, &Config::default());
    assert!(e.contains("15 tokens"), "{e}");
    let p = checks::check_dispatch(&layout(), BUF, &x, None, &RoutingInfo::Cached { handle_buffer: BUF, handle_tokens: 16 }, &Config::default(), None).unwrap();
    assert_eq!(p.num_topk, 0);
}

#[test]
fn dispatch_checks_config() {
    let x = t(DType::Bf16, &[16, 2048]);
    let (idx, w) = (t(DType::I64, &[16, 8]), t(DType::F32, &[16, 8]));
    let e = dispatch_err(&x, None, &fresh(&idx, &w, 16, 256), &Config::with_sms(133));
    assert!(e.contains("num_sms 133") && e.contains("132"), "{e}");
}

#[test]
fn layout_checks() {
    let e = checks::check_layout(&t(DType::I64, &[16, 8]), 256, 3).unwrap_err().to_string();
    assert!(e.contains("2, 4 or 8"), "{e}");
    let e = checks::check_layout(&t(DType::I64, &[16, 0]), 256, 2).unwrap_err().to_string();
    assert!(e.contains("top-k 0"), "{e}");
    let p = checks::check_layout(&t(DType::I64, &[0, 8]), 16, 8).unwrap();
    assert_eq!((p.num_tokens, p.num_topk), (0, 8));
}

fn handle(m: usize, n: usize, k: usize) -> HandleInfo {
    HandleInfo { buffer: BUF, num_tokens: n, num_recv_tokens: m, num_topk: k }
}

#[allow(clippy::too_many_arguments)]
fn combine(h: &HandleInfo, y: &TensorInfo, w: Option<&TensorInfo>, b: [Option<&TensorInfo>; 2], out: &TensorInfo, ow: Option<&TensorInfo>) -> Result<checks::CombinePlan, String> {
    checks::check_combine(&layout(), BUF, h, y, w, b, out, ow, &Config::default(), Some(132)).map_err(|e| e.to_string())
}

#[test]
fn combine_good_and_bad() {
    let h = handle(30, 20, 8);
    let (y, out) = (t(DType::Bf16, &[30, 4096]), t(DType::Bf16, &[20, 4096]));
    let (w, ow, b) = (t(DType::F32, &[30, 8]), t(DType::F32, &[20, 8]), t(DType::Bf16, &[20, 4096]));
    let p = combine(&h, &y, Some(&w), [Some(&b), Some(&b)], &out, Some(&ow)).unwrap();
    assert_eq!((p.num_tokens, p.num_recv_tokens, p.hidden, p.num_topk, p.with_weights), (20, 30, 4096, 8, true));

    let e = combine(&h, &t(DType::Bf16, &[29, 4096]), None, [None, None], &out, None).unwrap_err();
    assert!(e.contains("29 rows") && e.contains("30"), "{e}");
    let e = combine(&h, &t(DType::F32, &[30, 4096]), None, [None, None], &out, None).unwrap_err();
    assert!(e.contains("bf16 only"), "{e}");
    let e = combine(&h, &y, Some(&w), [None, None], &out, None).unwrap_err();
    assert!(e.contains("no output for the combined weights"), "{e}");
    let e = combine(&h, &y, None, [None, None], &out, Some(&ow)).unwrap_err();
    assert!(e.contains("no topk_weights"), "{e}");
    let e = combine(&h, &y, Some(&t(DType::F32, &[30, 6])), [None, None], &out, Some(&ow)).unwrap_err();
    assert!(e.contains("[30, 8]"), "{e}");
    let e = combine(&h, &y, None, [Some(&t(DType::Bf16, &[19, 4096])), None], &out, None).unwrap_err();
    assert!(e.contains("bias0") && e.contains("[20, 4096]"), "{e}");
    let e = combine(&h, &y, None, [None, None], &t(DType::Bf16, &[20, 2048]), None).unwrap_err();
    assert!(e.contains("combined_x (output)"), "{e}");
    let other = HandleInfo { buffer: BUF + 1, ..h };
    let e = combine(&other, &y, None, [None, None], &out, None).unwrap_err();
    assert!(e.contains("different Buffer"), "{e}");
}

#[test]
fn outputs_must_not_overlap_inputs() {
    let y = TensorInfo::contiguous(DType::Bf16, &[30, 4096], BASE);
    let out_overlapping = TensorInfo::contiguous(DType::Bf16, &[20, 4096], BASE + 4096 * 2 * 10);
    let e = checks::check_disjoint("combined_x", &out_overlapping, "y", &y).unwrap_err().to_string();
    assert!(e.contains("overlaps"), "{e}");
    let out_after = TensorInfo::contiguous(DType::Bf16, &[20, 4096], BASE + 4096 * 2 * 30);
    checks::check_disjoint("combined_x", &out_after, "y", &y).unwrap();
}

#[test]
fn buffer_size_formula_scales_with_ranks() {
    let l2 = BufferLayout::new(2, 4096, 7168).unwrap().total_bytes;
    let l8 = BufferLayout::new(8, 4096, 7168).unwrap().total_bytes;
    let row = 4096 * 7168 * 2;
    // recv R*N rows + stage (R-1)*N rows, plus metadata.
    assert!(l2 >= 3 * row && l2 < 3 * row + (16 << 20), "{l2}");
    assert!(l8 >= 15 * row && l8 < 15 * row + (64 << 20), "{l8}");
}

#[test]
fn cubins_have_every_kernel_the_buffer_launches_without_spills() {
    use deepep_kernels::cubins;
    let layout = cubins::require("layout").unwrap();
    assert_eq!(layout.kernels, ["ep_layout"]);
    let c = cubins::require("intranode").unwrap();
    let mut want = vec!["ep_intranode_notify".to_string()];
    for r in [2, 4, 8] {
        want.push(format!("ep_intranode_dispatch_r{r}"));
        want.push(format!("ep_intranode_combine_r{r}"));
    }
    for k in &want {
        let res = c.resources_of(k).unwrap_or_else(|| panic!("intranode cubin lacks {k}: {:?}", c.kernels));
        assert_eq!(res.spill_bytes, 0, "{k} spills");
        // 24 warps x 32 lanes x registers must fit the 64K register file (one block per SM).
        assert!(res.registers as usize * 32 * deepep_kernels::config::MAX_WARPS_PER_BLOCK <= 65536, "{k}: {} registers", res.registers);
    }
}

#[test]
fn a_planned_dispatch_is_checked_once_against_the_buffer() {
    // the plan of tensors the Python entry points already checked (crate::args::dispatch): the
    // buffer fills in the routing and refuses only what it alone knows
    use deepep_kernels::args::{self, Arg, Device, Routing};
    let a = |d: DType, s: &[usize]| Arg::contiguous(d, s, BASE, Device::Cuda(0));
    let (xa, ia, wa, pr, pe, ir) = (a(DType::Bf16, &[16, 4096]), a(DType::I64, &[16, 8]), a(DType::F32, &[16, 8]), a(DType::I32, &[2]), a(DType::I32, &[64]), a(DType::Bool, &[16, 2]));
    let routing = Routing { topk: Some((&ia, &wa)), per_rank: &pr, per_rdma_rank: None, per_expert: &pe, in_rank: &ir };
    let plan = args::dispatch(&xa, None, Some(routing), 2, 0).unwrap();
    assert_eq!((plan.num_topk, plan.num_experts, plan.expert_alignment, plan.row_bytes), (8, 64, 1, 8192));
    let (idx, w) = (t(DType::I64, &[16, 8]), t(DType::F32, &[16, 8]));
    let aligned4 = RoutingInfo::Fresh { layout_tokens: 16, num_experts: 64, topk_idx: &idx, topk_weights: &w, expert_alignment: 4 };
    let p = checks::check_planned(&layout(), BUF, plan, BASE, None, &aligned4, &Config::default(), Some(132)).unwrap();
    assert_eq!((p.num_topk, p.num_experts, p.expert_alignment), (8, 64, 4));
    // the same plan as the one check_dispatch makes from the tensors
    let x = t(DType::Bf16, &[16, 4096]);
    assert_eq!(checks::check_dispatch(&layout(), BUF, &x, None, &aligned4, &Config::default(), Some(132)).unwrap(), p);
    let e = checks::check_planned(&layout(), BUF, plan, BASE + 8, None, &aligned4, &Config::default(), Some(132)).unwrap_err().to_string();
    assert!(e.contains("16-byte aligned"), "{e}");
    let wide = args::dispatch(&a(DType::Bf16, &[16, 8192]), None, None, 2, 0).unwrap();
    let cached = RoutingInfo::Cached { handle_buffer: BUF, handle_tokens: 16 };
    let e = checks::check_planned(&layout(), BUF, wide, BASE, None, &cached, &Config::default(), Some(132)).unwrap_err().to_string();
    assert!(e.contains("hidden <= 7168"), "{e}");
    let other = RoutingInfo::Cached { handle_buffer: BUF + 1, handle_tokens: 16 };
    let e = checks::check_planned(&layout(), BUF, plan, BASE, None, &other, &Config::default(), Some(132)).unwrap_err().to_string();
    assert!(e.contains("different Buffer"), "{e}");
}

#[test]
fn a_planned_combine_is_checked_once_against_the_buffer() {
    let h = handle(30, 20, 8);
    let plan = checks::CombinePlan { num_tokens: 20, num_recv_tokens: 30, hidden: 4096, num_topk: 8, with_weights: true };
    let (y, out) = (t(DType::Bf16, &[30, 4096]), t(DType::Bf16, &[20, 4096]));
    let ok = checks::check_combine_planned(&layout(), BUF, &h, plan, &[("y", &y), ("combined_x (output)", &out)], &Config::default(), Some(132)).unwrap();
    assert_eq!(ok, plan);
    // the same plan as check_combine makes from the tensors
    let (w, ow) = (t(DType::F32, &[30, 8]), t(DType::F32, &[20, 8]));
    assert_eq!(combine(&h, &y, Some(&w), [None, None], &out, Some(&ow)).unwrap(), plan);
    let odd = TensorInfo { ptr: BASE + 8, ..y.clone() };
    let e = checks::check_combine_planned(&layout(), BUF, &h, plan, &[("y", &odd)], &Config::default(), Some(132)).unwrap_err().to_string();
    assert!(e.contains("y starts at") && e.contains("16-byte aligned"), "{e}");
    let e = checks::check_combine_planned(&layout(), BUF, &h, checks::CombinePlan { hidden: 8192, ..plan }, &[], &Config::default(), Some(132)).unwrap_err().to_string();
    assert!(e.contains("hidden <= 7168"), "{e}");
    let e = checks::check_combine_planned(&layout(), BUF, &h, checks::CombinePlan { num_recv_tokens: 29, ..plan }, &[], &Config::default(), Some(132)).unwrap_err().to_string();
    assert!(e.contains("29 received rows"), "{e}");
    let e = checks::check_combine_planned(&layout(), BUF + 1, &h, plan, &[], &Config::default(), Some(132)).unwrap_err().to_string();
    assert!(e.contains("different Buffer"), "{e}");
    let e = checks::check_combine_planned(&layout(), BUF, &h, checks::CombinePlan { num_topk: 4, ..plan }, &[], &Config::default(), Some(132)).unwrap_err().to_string();
    assert!(e.contains("[30, 4] but must be [30, 8]"), "{e}");
}
