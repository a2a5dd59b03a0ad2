//! The Python entry points' argument checks (`deepep_kernels::args`) on plain `Arg`s: no GPU.

use deepep_kernels::args::{self, Arg, CombineDims, Device, LlCombineDims};
use deepep_kernels::tensor::DType;

fn cuda(dtype: DType, shape: &[usize]) -> Arg {
    Arg::contiguous(dtype, shape, 0x1000, Device::Cuda(0))
}

fn err(r: deepep_kernels::Result<impl std::fmt::Debug>) -> String {
    r.unwrap_err().to_string()
}

#[test]
fn ll_dispatch_order_is_dtype_shape_contiguity_device() {
    let x = cuda(DType::Bf16, &[6, 256]);
    let idx = cuda(DType::I64, &[6, 4]);
    let p = args::ll_dispatch(&x, &idx, None, 16, 8, 2, 0).unwrap();
    assert_eq!((p.num_tokens, p.hidden, p.num_topk), (6, 256, 4));
    // a CPU tensor of the wrong dtype is refused for its dtype; a right one only for its device
    let cpu_f32 = Arg { device: Device::Cpu, ..cuda(DType::F32, &[6, 256]) };
    assert!(err(args::ll_dispatch(&cpu_f32, &idx, None, 16, 8, 2, 0)).contains("x must be torch.bfloat16, got torch.float32"));
    let cpu = Arg { device: Device::Cpu, ..x.clone() };
    assert!(err(args::ll_dispatch(&cpu, &idx, None, 16, 8, 2, 0)).contains("x must be on a CUDA device (got cpu); move it with .cuda()"));
    let short = cuda(DType::I64, &[5, 4]);
    assert!(err(args::ll_dispatch(&x, &short, None, 16, 8, 2, 0)).contains("topk_idx has 5 rows but x has 6"));
    assert!(err(args::ll_dispatch(&x, &idx, None, 4, 8, 2, 0)).contains("more than num_max_dispatch_tokens_per_rank=4"));
    let strided = Arg { strides: vec![512, 1], ..x.clone() };
    assert!(err(args::ll_dispatch(&strided, &idx, None, 16, 8, 2, 0)).contains("x must be contiguous"));
    let stats = cuda(DType::I32, &[3]);
    assert!(err(args::ll_dispatch(&x, &idx, Some(&stats), 16, 8, 2, 0)).contains("cumulative_local_expert_recv_stats must be [4]"));
    let other_gpu = Arg { device: Device::Cuda(1), ..x.clone() };
    assert!(err(args::ll_dispatch(&other_gpu, &idx, None, 16, 8, 2, 0)).contains("is on cuda:1 but this Buffer uses cuda:0"));
    let f16 = Arg { dtype: Err("torch.float16".into()), ..x };
    assert!(err(args::ll_dispatch(&f16, &idx, None, 16, 8, 2, 0)).contains("got torch.float16"));
}

#[test]
fn ll_combine_shapes_follow_the_handle() {
    let d = LlCombineDims { num_tokens: 10, num_topk: 4, hidden: 256, local_experts: 3, rows: 32 };
    let (x, idx, w, out) = (cuda(DType::Bf16, &[3, 32, 256]), cuda(DType::I64, &[10, 4]), cuda(DType::F32, &[10, 4]), cuda(DType::Bf16, &[10, 256]));
    args::ll_combine(&x, &idx, &w, Some(&out), None, d, 0).unwrap();
    args::ll_combine(&x, &idx, &w, None, None, d, 0).unwrap();
    let half = cuda(DType::Bf16, &[3, 16, 256]);
    assert!(err(args::ll_combine(&half, &idx, &w, None, None, d, 0)).contains("low_latency_combine: x is [3, 16, 256], but the handle's dispatch packed [3, 32, 256]"));
    let w3 = cuda(DType::F32, &[10, 3]);
    assert!(err(args::ll_combine(&x, &idx, &w3, None, None, d, 0)).contains("low_latency_combine: topk_weights is [10, 3]"));
    let narrow = cuda(DType::Bf16, &[10, 128]);
    assert!(err(args::ll_combine(&x, &idx, &w, Some(&narrow), None, d, 0)).contains("low_latency_combine: out is [10, 128], must be [10, 256]"));
    // zero copy: x only has to have the handed-out buffer's shape
    assert!(err(args::ll_combine(&half, &idx, &w, None, Some(&x), d, 0)).contains("zero_copy=True: x has shape [3, 16, 256]"));
}

#[test]
fn dispatch_routing_and_scales() {
    let x = cuda(DType::Fp8E4m3, &[6, 256]);
    let row = cuda(DType::F32, &[6, 2]);
    let col = Arg { strides: vec![1, 6], ..row.clone() };
    let (idx, w, pr, pe, ir) = (cuda(DType::I64, &[6, 8]), cuda(DType::F32, &[6, 8]), cuda(DType::I32, &[4]), cuda(DType::I32, &[32]), cuda(DType::Bool, &[6, 4]));
    let r = args::Routing { topk: Some((&idx, &w)), per_rank: &pr, per_rdma_rank: None, per_expert: &pe, in_rank: &ir };
    assert_eq!(args::dispatch(&x, Some(&row), Some(r), 4, 0).unwrap().scales_column_major, Some(false));
    assert_eq!(args::dispatch(&x, Some(&col), Some(r), 4, 0).unwrap().scales_column_major, Some(true));
    let three = cuda(DType::F32, &[6, 3]);
    assert!(err(args::dispatch(&x, Some(&three), Some(r), 4, 0)).contains("x scales must be float32 [num_tokens=6, hidden/128=2], got torch.float32 [6, 3]"));
    let neither = Arg { strides: vec![4, 1], ..row };
    assert!(err(args::dispatch(&x, Some(&neither), Some(r), 4, 0)).contains("x scales must be row-major or column-major"));
    let idx5 = cuda(DType::I64, &[5, 8]);
    let bad = args::Routing { topk: Some((&idx5, &w)), ..r };
    assert!(err(args::dispatch(&x, Some(&col), Some(bad), 4, 0)).contains("topk_idx must be [6, 8] (one row per token of x: 6 tokens), got [5, 8]"));
    let pe30 = cuda(DType::I32, &[30]);
    let bad = args::Routing { per_expert: &pe30, ..r };
    assert!(err(args::dispatch(&x, Some(&col), Some(bad), 4, 0)).contains("num_tokens_per_expert has 30 experts, not a multiple of the 4 ranks"));
    let pr2 = cuda(DType::I32, &[2]);
    let bad = args::Routing { per_rdma_rank: Some((&pr2, 2)), ..r };
    args::dispatch(&x, Some(&col), Some(bad), 4, 0).unwrap();
    let pr4 = cuda(DType::I32, &[4]);
    let bad = args::Routing { per_rdma_rank: Some((&pr4, 2)), ..r };
    assert!(err(args::dispatch(&x, Some(&col), Some(bad), 4, 0)).contains("num_tokens_per_rdma_rank must be [2]"));
    let bf = cuda(DType::Bf16, &[6, 256]);
    assert!(err(args::dispatch(&bf, Some(&col), None, 4, 0)).contains("with scales, x must be float8_e4m3fn"));
    assert!(err(args::dispatch(&x, None, None, 4, 0)).contains("x must be bfloat16, or a (float8_e4m3fn x, float32 scales) tuple"));
}

#[test]
fn combine_against_the_handle_and_generations_and_capacity() {
    let d = CombineDims { num_tokens: 6, num_recv_tokens: 10, num_rows: 12, hidden: None };
    let (x, out) = (cuda(DType::Bf16, &[12, 256]), cuda(DType::Bf16, &[6, 256]));
    let (w, ow) = (cuda(DType::F32, &[12, 4]), cuda(DType::F32, &[6, 4]));
    assert_eq!(args::combine(&x, Some(&w), [None, None], Some(&out), Some(&ow), d, 0).unwrap(), (256, Some(4)));
    let x9 = cuda(DType::Bf16, &[9, 256]);
    assert!(err(args::combine(&x9, None, [None, None], Some(&out), None, d, 0)).contains("combine: x has 9 rows but the handle's dispatch produced 12 (10 received)"));
    let b = cuda(DType::Bf16, &[5, 256]);
    assert!(err(args::combine(&x, None, [None, Some(&b)], Some(&out), None, d, 0)).contains("bias[1] must be [6, 256], got [5, 256]"));
    assert!(err(args::combine(&x, Some(&w), [None, None], Some(&out), None, d, 0)).contains("out_weights must be given exactly when topk_weights are"));
    let inter = CombineDims { hidden: Some(128), ..d };
    assert!(err(args::combine(&x, None, [None, None], None, None, inter, 0)).contains("order and width of recv_x"));
    assert!(err(args::normal_generation(1, 2, false)).contains("NVLink buffer was re-created since"));
    assert!(err(args::ll_generation(1, 2, "hook")).contains("this receive hook's low-latency buffer was destroyed or re-created"));
    assert!(err(args::ll_generation(1, 2, "handle")).contains("this low-latency handle's buffer was destroyed or re-created"));
    args::ll_generation(3, 3, "hook").unwrap();
    assert!(err(args::nvl_capacity(200, 128, 7168, 8, 1 << 20, 1 << 21)).contains("create the Buffer with num_nvl_bytes >= 2097152"));
    assert!(err(args::ll_capacity(100, 10, 128, 7168, 288, 8)).contains("Buffer.get_low_latency_rdma_size_hint"));
}
