"""Snapshots of the rewritten graphs (the graph handed to Inductor), pinned with expecttest.

Each ``collage::chain`` node's arithmetic (``collage_compile.fuse``) is printed after the graph as
the aten graph Inductor lowers inline.  Tiny fixed shapes, CPU, ``dynamic=False``, a fresh Dynamo per test.  Refresh after an
intended change with ``EXPECTTEST_ACCEPT=1 pytest tests/test_snapshots.py`` and review the
diff: it shows exactly which arithmetic the rewrite now emits.  The graphs are the ones
Dynamo produces on torch 2.13; other versions trace optimizers differently.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
from conftest import GraphCapture, normalize_gm

import collage_compile
from collage_compile import _compat, fuse

pytestmark = pytest.mark.skipif(
    not _compat.torch_version().startswith("2.13"),
    reason="snapshots are of torch 2.13's Dynamo graphs",
)


class TestRewrittenGraphs(expecttest.TestCase):
    def setUp(self):
        _compat.reset_dynamo()
        # a chain's aten trace is shared by chains of other shapes (fuse._SHAPE_FREE); the
        # printout annotates the shapes it was traced with, so trace these tiny ones afresh
        fuse._SHAPE_FREE.clear()
        self.monkeypatch = pytest.MonkeyPatch()
        self.capture = GraphCapture(self.monkeypatch)

    def tearDown(self):
        self.monkeypatch.undo()
        _compat.reset_dynamo()

    def rewritten(self, make_opt, backend=collage_compile.backend) -> str:
        p = torch.nn.Parameter(torch.linspace(-1, 1, 6).reshape(2, 3).bfloat16())
        opt = make_opt([p])
        p.grad = torch.full_like(p, 0.5)
        step = torch.compile(opt.step, backend=backend, dynamic=False)
        step()
        self.assertEqual(len(self.capture.graphs), 1)
        return normalize_gm(self.capture.graphs[0])

    def test_sgd_single_tensor(self):
        self.assertExpectedInline(
            self.rewritten(lambda ps: torch.optim.SGD(ps, lr=1e-3, foreach=False)),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_param_groups_0_params_0_grad: "bf16[2, 3]", collage_lo_x: "bf16[2, 3]"):
        l_self_param_groups_0_params_0_grad = L_self_param_groups_0_params_0_grad
        x: "bf16[2, 3]" = self.self___param_groups_0__params___0
        chain_default = torch.ops.collage.chain.default('chain_0', [x, collage_lo_x, l_self_param_groups_0_params_0_grad]);  l_self_param_groups_0_params_0_grad = None
        getitem: "bf16[2, 3]" = chain_default[0]
        getitem_1: "bf16[2, 3]" = chain_default[1];  chain_default = None
        copy_ = x.copy_(getitem);  x = getitem = copy_ = None
        copy__1 = collage_lo_x.copy_(getitem_1);  collage_lo_x = getitem_1 = copy__1 = None
        return ()
class chain_0(torch.nn.Module):
    def forward(self, arg0_1: "bf16[2, 3]", arg1_1: "bf16[2, 3]", arg2_1: "bf16[2, 3]"):
        convert_element_type: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg0_1, torch.float32);  arg0_1 = None
        convert_element_type_1: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg1_1, torch.float32);  arg1_1 = None
        abs_1: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type)
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(abs_1, 0.00390625);  abs_1 = None
        abs_2: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type_1)
        le: "b8[2, 3]" = torch.ops.aten.le.Tensor(abs_2, mul);  abs_2 = mul = None
        scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where: "f32[2, 3]" = torch.ops.aten.where.self(le, convert_element_type_1, scalar_tensor);  le = convert_element_type_1 = scalar_tensor = None
        convert_element_type_2: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg2_1, torch.float32);  arg2_1 = None
        mul_1: "f32[2, 3]" = torch.ops.aten.mul.Tensor(convert_element_type_2, -0.001);  convert_element_type_2 = None
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(where, mul_1);  where = mul_1 = None
        add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(convert_element_type, add)
        mul_2: "f32[2, 3]" = torch.ops.aten.mul.Tensor(add_1, 65536.0)
        add_2: "f32[2, 3]" = torch.ops.aten.add.Tensor(mul_2, add_1);  mul_2 = None
        sub: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_2, add_1)
        sub_1: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_2, sub);  add_2 = sub = None
        abs_3: "f32[2, 3]" = torch.ops.aten.abs.default(sub_1)
        lt: "b8[2, 3]" = torch.ops.aten.lt.Scalar(abs_3, inf);  abs_3 = None
        sub_2: "f32[2, 3]" = torch.ops.aten.sub.Tensor(convert_element_type, sub_1);  convert_element_type = sub_1 = None
        add_3: "f32[2, 3]" = torch.ops.aten.add.Tensor(sub_2, add);  sub_2 = add = None
        convert_element_type_3: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(add_1, torch.bfloat16);  add_1 = None
        scalar_tensor_1: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_1: "f32[2, 3]" = torch.ops.aten.where.self(lt, add_3, scalar_tensor_1);  lt = add_3 = scalar_tensor_1 = None
        convert_element_type_4: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(where_1, torch.bfloat16);  where_1 = None
        return (convert_element_type_3, convert_element_type_4)""",
        )

    def test_sgd_foreach(self):
        self.assertExpectedInline(
            self.rewritten(lambda ps: torch.optim.SGD(ps, lr=1e-3, foreach=True)),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_param_groups_0_params_0_grad: "bf16[2, 3]", collage_lo_self___param_groups_0__params___0: "bf16[2, 3]"):
        l_self_param_groups_0_params_0_grad = L_self_param_groups_0_params_0_grad
        self___param_groups_0__params___0: "bf16[2, 3]" = self.self___param_groups_0__params___0
        chain_default = torch.ops.collage.chain.default('chain_0', [self___param_groups_0__params___0, collage_lo_self___param_groups_0__params___0, l_self_param_groups_0_params_0_grad]);  l_self_param_groups_0_params_0_grad = None
        getitem: "bf16[2, 3]" = chain_default[0]
        getitem_1: "bf16[2, 3]" = chain_default[1];  chain_default = None
        copy_ = self___param_groups_0__params___0.copy_(getitem);  self___param_groups_0__params___0 = getitem = copy_ = None
        copy__1 = collage_lo_self___param_groups_0__params___0.copy_(getitem_1);  collage_lo_self___param_groups_0__params___0 = getitem_1 = copy__1 = None
        return ()
class chain_0(torch.nn.Module):
    def forward(self, arg0_1: "bf16[2, 3]", arg1_1: "bf16[2, 3]", arg2_1: "bf16[2, 3]"):
        convert_element_type: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg0_1, torch.float32);  arg0_1 = None
        convert_element_type_1: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg1_1, torch.float32);  arg1_1 = None
        abs_1: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type)
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(abs_1, 0.00390625);  abs_1 = None
        abs_2: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type_1)
        le: "b8[2, 3]" = torch.ops.aten.le.Tensor(abs_2, mul);  abs_2 = mul = None
        scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where: "f32[2, 3]" = torch.ops.aten.where.self(le, convert_element_type_1, scalar_tensor);  le = convert_element_type_1 = scalar_tensor = None
        convert_element_type_2: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg2_1, torch.float32);  arg2_1 = None
        mul_1: "f32[2, 3]" = torch.ops.aten.mul.Tensor(convert_element_type_2, -0.001);  convert_element_type_2 = None
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(where, mul_1);  where = mul_1 = None
        add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(convert_element_type, add)
        mul_2: "f32[2, 3]" = torch.ops.aten.mul.Tensor(add_1, 65536.0)
        add_2: "f32[2, 3]" = torch.ops.aten.add.Tensor(mul_2, add_1);  mul_2 = None
        sub: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_2, add_1)
        sub_1: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_2, sub);  add_2 = sub = None
        abs_3: "f32[2, 3]" = torch.ops.aten.abs.default(sub_1)
        lt: "b8[2, 3]" = torch.ops.aten.lt.Scalar(abs_3, inf);  abs_3 = None
        sub_2: "f32[2, 3]" = torch.ops.aten.sub.Tensor(convert_element_type, sub_1);  convert_element_type = sub_1 = None
        add_3: "f32[2, 3]" = torch.ops.aten.add.Tensor(sub_2, add);  sub_2 = add = None
        convert_element_type_3: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(add_1, torch.bfloat16);  add_1 = None
        scalar_tensor_1: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_1: "f32[2, 3]" = torch.ops.aten.where.self(lt, add_3, scalar_tensor_1);  lt = add_3 = scalar_tensor_1 = None
        convert_element_type_4: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(where_1, torch.bfloat16);  where_1 = None
        return (convert_element_type_3, convert_element_type_4)""",
        )

    def test_adamw_single_tensor(self):
        self.assertExpectedInline(
            self.rewritten(
                lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=False)
            ),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_param_groups_0_params_0_grad: "bf16[2, 3]", collage_lo_x: "bf16[2, 3]"):
        l_self_param_groups_0_params_0_grad = L_self_param_groups_0_params_0_grad
        x: "bf16[2, 3]" = self.self___param_groups_0__params___0
        step_t: "f32[]" = self.self___state_list_dict_keys_L__self___state___0__list_dict_keys_L__self___state_list_dict_keys_L__self___state___0____0
        step_t += 1;  step_t_1: "f32[]" = step_t;  step_t = None
        exp_avg: "bf16[2, 3]" = self.self___state_list_dict_keys_L__self___state___0__list_dict_keys_L__self___state_list_dict_keys_L__self___state___0____1
        lerp_: "bf16[2, 3]" = exp_avg.lerp_(l_self_param_groups_0_params_0_grad, 0.09999999999999998);  lerp_ = None
        exp_avg_sq: "bf16[2, 3]" = self.self___state_list_dict_keys_L__self___state___0__list_dict_keys_L__self___state_list_dict_keys_L__self___state___0____2
        mul__1: "bf16[2, 3]" = exp_avg_sq.mul_(0.999)
        mul: "bf16[2, 3]" = torch.mul(l_self_param_groups_0_params_0_grad, l_self_param_groups_0_params_0_grad);  l_self_param_groups_0_params_0_grad = None
        fma_default: "bf16[2, 3]" = torch.ops.prims.fma.default(mul, 0.0010000000000000009, mul__1);  mul = None
        copy_: "bf16[2, 3]" = mul__1.copy_(fma_default);  mul__1 = fma_default = copy_ = None
        pow_1: "f32[]" = 0.9 ** step_t_1
        bias_correction1: "f32[]" = 1 - pow_1;  pow_1 = None
        pow_2: "f32[]" = 0.999 ** step_t_1;  step_t_1 = None
        bias_correction2: "f32[]" = 1 - pow_2;  pow_2 = None
        step_size: "f32[]" = 0.001 / bias_correction1;  bias_correction1 = None
        step_size_neg: "f32[]" = step_size.neg();  step_size = None
        bias_correction2_sqrt: "f32[]" = bias_correction2.sqrt();  bias_correction2 = None
        sqrt_1: "bf16[2, 3]" = exp_avg_sq.sqrt();  exp_avg_sq = None
        truediv = sqrt_1 / bias_correction2_sqrt;  sqrt_1 = bias_correction2_sqrt = None
        add = truediv + 1e-08;  truediv = None
        truediv_3: "bf16[2, 3]" = add / step_size_neg;  add = step_size_neg = None
        chain_default = torch.ops.collage.chain.default('chain_0', [x, collage_lo_x, exp_avg, truediv_3]);  exp_avg = truediv_3 = None
        getitem: "bf16[2, 3]" = chain_default[0]
        getitem_1: "bf16[2, 3]" = chain_default[1];  chain_default = None
        copy__1 = x.copy_(getitem);  x = getitem = copy__1 = None
        copy__2 = collage_lo_x.copy_(getitem_1);  collage_lo_x = getitem_1 = copy__2 = None
        return ()
class chain_0(torch.nn.Module):
    def forward(self, arg0_1: "bf16[2, 3]", arg1_1: "bf16[2, 3]", arg2_1: "bf16[2, 3]", arg3_1: "bf16[2, 3]"):
        convert_element_type: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg0_1, torch.float32);  arg0_1 = None
        convert_element_type_1: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg1_1, torch.float32);  arg1_1 = None
        abs_1: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type)
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(abs_1, 0.00390625);  abs_1 = None
        abs_2: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type_1)
        le: "b8[2, 3]" = torch.ops.aten.le.Tensor(abs_2, mul);  abs_2 = mul = None
        scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where: "f32[2, 3]" = torch.ops.aten.where.self(le, convert_element_type_1, scalar_tensor);  le = convert_element_type_1 = scalar_tensor = None
        mul_1: "f32[2, 3]" = torch.ops.aten.mul.Tensor(where, 0.9999899864196777);  where = None
        mul_2: "f32[2, 3]" = torch.ops.aten.mul.Tensor(convert_element_type, -9.999999747378752e-06)
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(mul_1, mul_2);  mul_1 = mul_2 = None
        convert_element_type_2: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg2_1, torch.float32);  arg2_1 = None
        convert_element_type_3: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg3_1, torch.float32);  arg3_1 = None
        div: "f32[2, 3]" = torch.ops.aten.div.Tensor(convert_element_type_2, convert_element_type_3);  convert_element_type_2 = convert_element_type_3 = None
        add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(add, div);  add = div = None
        add_2: "f32[2, 3]" = torch.ops.aten.add.Tensor(convert_element_type, add_1)
        mul_3: "f32[2, 3]" = torch.ops.aten.mul.Tensor(add_2, 65536.0)
        add_3: "f32[2, 3]" = torch.ops.aten.add.Tensor(mul_3, add_2);  mul_3 = None
        sub: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_3, add_2)
        sub_1: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_3, sub);  add_3 = sub = None
        abs_3: "f32[2, 3]" = torch.ops.aten.abs.default(sub_1)
        lt: "b8[2, 3]" = torch.ops.aten.lt.Scalar(abs_3, inf);  abs_3 = None
        sub_2: "f32[2, 3]" = torch.ops.aten.sub.Tensor(convert_element_type, sub_1);  convert_element_type = sub_1 = None
        add_4: "f32[2, 3]" = torch.ops.aten.add.Tensor(sub_2, add_1);  sub_2 = add_1 = None
        convert_element_type_4: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(add_2, torch.bfloat16);  add_2 = None
        scalar_tensor_1: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_1: "f32[2, 3]" = torch.ops.aten.where.self(lt, add_4, scalar_tensor_1);  lt = add_4 = scalar_tensor_1 = None
        convert_element_type_5: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(where_1, torch.bfloat16);  where_1 = None
        return (convert_element_type_4, convert_element_type_5)""",
        )

    def test_adamw_foreach(self):
        self.assertExpectedInline(
            self.rewritten(
                lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True)
            ),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_param_groups_0_params_0_grad: "bf16[2, 3]", collage_lo_self___param_groups_0__params___0: "bf16[2, 3]"):
        l_self_param_groups_0_params_0_grad = L_self_param_groups_0_params_0_grad
        self___param_groups_0__params___0: "bf16[2, 3]" = self.self___param_groups_0__params___0
        self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____1: "bf16[2, 3]" = self.self___state_list_dict_keys_L__self___state___0__list_dict_keys_L__self___state_list_dict_keys_L__self___state___0____1
        self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2: "bf16[2, 3]" = self.self___state_list_dict_keys_L__self___state___0__list_dict_keys_L__self___state_list_dict_keys_L__self___state___0____2
        self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____0: "f32[]" = self.self___state_list_dict_keys_L__self___state___0__list_dict_keys_L__self___state_list_dict_keys_L__self___state___0____0
        _foreach_add_ = torch._foreach_add_([self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____0], 1);  _foreach_add_ = None
        _foreach_sub = torch._foreach_sub([l_self_param_groups_0_params_0_grad], [self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____1])
        d: "bf16[2, 3]" = _foreach_sub[0];  _foreach_sub = None
        full_like: "bf16[2, 3]" = torch.full_like(d, 0.09999999999999998)
        _foreach_addcmul_ = torch._foreach_addcmul_([self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____1], [full_like], (d,));  full_like = d = _foreach_addcmul_ = None
        _foreach_mul__1 = torch._foreach_mul_([self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2], 0.999);  _foreach_mul__1 = None
        _foreach_addcmul__1 = torch._foreach_addcmul_([self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2], [l_self_param_groups_0_params_0_grad], [l_self_param_groups_0_params_0_grad], 0.0010000000000000009);  l_self_param_groups_0_params_0_grad = _foreach_addcmul__1 = None
        _foreach_pow = torch._foreach_pow(0.9, [self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____0])
        getitem_6: "f32[]" = _foreach_pow[0];  _foreach_pow = None
        _foreach_pow_1 = torch._foreach_pow(0.999, [self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____0]);  self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____0 = None
        getitem_7: "f32[]" = _foreach_pow_1[0];  _foreach_pow_1 = None
        _foreach_sub_ = torch._foreach_sub_((getitem_6,), 1);  _foreach_sub_ = None
        _foreach_sub__1 = torch._foreach_sub_((getitem_7,), 1);  _foreach_sub__1 = None
        _foreach_neg_ = torch._foreach_neg_((getitem_7,));  _foreach_neg_ = None
        _foreach_div_ = torch._foreach_div_((getitem_6,), 0.001);  _foreach_div_ = None
        _foreach_reciprocal_ = torch._foreach_reciprocal_((getitem_6,));  _foreach_reciprocal_ = None
        _foreach_sqrt_ = torch._foreach_sqrt_((getitem_7,));  _foreach_sqrt_ = None
        _foreach_sqrt = torch._foreach_sqrt([self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2]);  self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2 = None
        getitem_14: "bf16[2, 3]" = _foreach_sqrt[0];  _foreach_sqrt = None
        _foreach_div__1 = torch._foreach_div_((getitem_14,), (getitem_7,));  getitem_7 = _foreach_div__1 = None
        _foreach_add__1 = torch._foreach_add_((getitem_14,), 1e-08);  _foreach_add__1 = None
        _foreach_div__2 = torch._foreach_div_((getitem_14,), (getitem_6,));  getitem_6 = _foreach_div__2 = None
        chain_default = torch.ops.collage.chain.default('chain_0', [self___param_groups_0__params___0, collage_lo_self___param_groups_0__params___0, self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____1, getitem_14]);  self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____1 = getitem_14 = None
        getitem: "bf16[2, 3]" = chain_default[0]
        getitem_15: "bf16[2, 3]" = chain_default[1];  chain_default = None
        copy_ = self___param_groups_0__params___0.copy_(getitem);  self___param_groups_0__params___0 = getitem = copy_ = None
        copy__1 = collage_lo_self___param_groups_0__params___0.copy_(getitem_15);  collage_lo_self___param_groups_0__params___0 = getitem_15 = copy__1 = None
        return ()
class chain_0(torch.nn.Module):
    def forward(self, arg0_1: "bf16[2, 3]", arg1_1: "bf16[2, 3]", arg2_1: "bf16[2, 3]", arg3_1: "bf16[2, 3]"):
        convert_element_type: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg0_1, torch.float32);  arg0_1 = None
        convert_element_type_1: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg1_1, torch.float32);  arg1_1 = None
        abs_1: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type)
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(abs_1, 0.00390625);  abs_1 = None
        abs_2: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type_1)
        le: "b8[2, 3]" = torch.ops.aten.le.Tensor(abs_2, mul);  abs_2 = mul = None
        scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where: "f32[2, 3]" = torch.ops.aten.where.self(le, convert_element_type_1, scalar_tensor);  le = convert_element_type_1 = scalar_tensor = None
        mul_1: "f32[2, 3]" = torch.ops.aten.mul.Tensor(where, 0.9999899864196777);  where = None
        mul_2: "f32[2, 3]" = torch.ops.aten.mul.Tensor(convert_element_type, -9.999999747378752e-06)
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(mul_1, mul_2);  mul_1 = mul_2 = None
        convert_element_type_2: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg2_1, torch.float32);  arg2_1 = None
        convert_element_type_3: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg3_1, torch.float32);  arg3_1 = None
        div: "f32[2, 3]" = torch.ops.aten.div.Tensor(convert_element_type_2, convert_element_type_3);  convert_element_type_2 = convert_element_type_3 = None
        add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(add, div);  add = div = None
        add_2: "f32[2, 3]" = torch.ops.aten.add.Tensor(convert_element_type, add_1)
        mul_3: "f32[2, 3]" = torch.ops.aten.mul.Tensor(add_2, 65536.0)
        add_3: "f32[2, 3]" = torch.ops.aten.add.Tensor(mul_3, add_2);  mul_3 = None
        sub: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_3, add_2)
        sub_1: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_3, sub);  add_3 = sub = None
        abs_3: "f32[2, 3]" = torch.ops.aten.abs.default(sub_1)
        lt: "b8[2, 3]" = torch.ops.aten.lt.Scalar(abs_3, inf);  abs_3 = None
        sub_2: "f32[2, 3]" = torch.ops.aten.sub.Tensor(convert_element_type, sub_1);  convert_element_type = sub_1 = None
        add_4: "f32[2, 3]" = torch.ops.aten.add.Tensor(sub_2, add_1);  sub_2 = add_1 = None
        convert_element_type_4: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(add_2, torch.bfloat16);  add_2 = None
        scalar_tensor_1: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_1: "f32[2, 3]" = torch.ops.aten.where.self(lt, add_4, scalar_tensor_1);  lt = add_4 = scalar_tensor_1 = None
        convert_element_type_5: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(where_1, torch.bfloat16);  where_1 = None
        return (convert_element_type_4, convert_element_type_5)""",
        )

    def test_adamax_foreach_plus(self):
        """plus carries exp_inf: its decay by 0.999 and the maximum over it, in one chain."""
        self.assertExpectedInline(
            self.rewritten(
                lambda ps: torch.optim.Adamax(ps, lr=1e-3, foreach=True),
                collage_compile.make_backend(mode="plus"),
            ),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_param_groups_0_params_0_grad: "bf16[2, 3]", collage_lo_self___param_groups_0__params___0: "bf16[2, 3]", collage_lo_self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2: "bf16[2, 3]"):
        l_self_param_groups_0_params_0_grad = L_self_param_groups_0_params_0_grad
        self___param_groups_0__params___0: "bf16[2, 3]" = self.self___param_groups_0__params___0
        self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____1: "bf16[2, 3]" = self.self___state_list_dict_keys_L__self___state___0__list_dict_keys_L__self___state_list_dict_keys_L__self___state___0____1
        self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2: "bf16[2, 3]" = self.self___state_list_dict_keys_L__self___state___0__list_dict_keys_L__self___state_list_dict_keys_L__self___state___0____2
        self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____0: "f32[]" = self.self___state_list_dict_keys_L__self___state___0__list_dict_keys_L__self___state_list_dict_keys_L__self___state___0____0
        _foreach_add_ = torch._foreach_add_([self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____0], 1);  _foreach_add_ = None
        _foreach_sub = torch._foreach_sub([l_self_param_groups_0_params_0_grad], [self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____1])
        d: "bf16[2, 3]" = _foreach_sub[0];  _foreach_sub = None
        full_like: "bf16[2, 3]" = torch.full_like(d, 0.09999999999999998)
        _foreach_addcmul_ = torch._foreach_addcmul_([self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____1], [full_like], (d,));  full_like = d = _foreach_addcmul_ = None
        _foreach_abs = torch._foreach_abs([l_self_param_groups_0_params_0_grad]);  l_self_param_groups_0_params_0_grad = None
        getitem_4: "bf16[2, 3]" = _foreach_abs[0];  _foreach_abs = None
        _foreach_add__1 = torch._foreach_add_((getitem_4,), 1e-08);  _foreach_add__1 = None
        chain_default = torch.ops.collage.chain.default('chain_0', [self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2, collage_lo_self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2, getitem_4]);  getitem_4 = None
        getitem: "bf16[2, 3]" = chain_default[0]
        getitem_11: "bf16[2, 3]" = chain_default[1];  chain_default = None
        copy_ = self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2.copy_(getitem);  getitem = copy_ = None
        copy__1 = collage_lo_self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2.copy_(getitem_11);  collage_lo_self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2 = getitem_11 = copy__1 = None
        _foreach_pow = torch._foreach_pow(0.9, [self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____0]);  self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____0 = None
        getitem_7: "f32[]" = _foreach_pow[0];  _foreach_pow = None
        _foreach_sub_ = torch._foreach_sub_((getitem_7,), 1);  _foreach_sub_ = None
        _foreach_div_ = torch._foreach_div_((getitem_7,), 0.001);  _foreach_div_ = None
        _foreach_mul = torch._foreach_mul([self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2], (getitem_7,));  self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____2 = getitem_7 = None
        getitem_10: "bf16[2, 3]" = _foreach_mul[0];  _foreach_mul = None
        chain_default_1 = torch.ops.collage.chain.default('chain_1', [self___param_groups_0__params___0, collage_lo_self___param_groups_0__params___0, self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____1, getitem_10]);  self___state_list_dict_keys_l__self___state___0__list_dict_keys_l__self___state_list_dict_keys_l__self___state___0____1 = getitem_10 = None
        getitem_12: "bf16[2, 3]" = chain_default_1[0]
        getitem_13: "bf16[2, 3]" = chain_default_1[1];  chain_default_1 = None
        copy__2 = self___param_groups_0__params___0.copy_(getitem_12);  self___param_groups_0__params___0 = getitem_12 = copy__2 = None
        copy__3 = collage_lo_self___param_groups_0__params___0.copy_(getitem_13);  collage_lo_self___param_groups_0__params___0 = getitem_13 = copy__3 = None
        return ()
class chain_0(torch.nn.Module):
    def forward(self, arg0_1: "bf16[2, 3]", arg1_1: "bf16[2, 3]", arg2_1: "bf16[2, 3]"):
        convert_element_type: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg0_1, torch.float32);  arg0_1 = None
        convert_element_type_1: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg1_1, torch.float32);  arg1_1 = None
        abs_1: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type)
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(abs_1, 0.00390625);  abs_1 = None
        abs_2: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type_1)
        le: "b8[2, 3]" = torch.ops.aten.le.Tensor(abs_2, mul);  abs_2 = mul = None
        scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where: "f32[2, 3]" = torch.ops.aten.where.self(le, convert_element_type_1, scalar_tensor);  le = convert_element_type_1 = scalar_tensor = None
        mul_1: "f32[2, 3]" = torch.ops.aten.mul.Tensor(where, 0.9990000128746033);  where = None
        mul_2: "f32[2, 3]" = torch.ops.aten.mul.Tensor(convert_element_type, -0.0010000000474974513)
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(mul_1, mul_2);  mul_1 = mul_2 = None
        convert_element_type_2: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg2_1, torch.float32);  arg2_1 = None
        sub: "f32[2, 3]" = torch.ops.aten.sub.Tensor(convert_element_type, convert_element_type_2)
        add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(sub, add);  sub = None
        lt: "b8[2, 3]" = torch.ops.aten.lt.Scalar(add_1, 0);  add_1 = None
        isnan: "b8[2, 3]" = torch.ops.aten.isnan.default(convert_element_type_2)
        bitwise_or: "b8[2, 3]" = torch.ops.aten.bitwise_or.Tensor(lt, isnan);  lt = isnan = None
        where_1: "f32[2, 3]" = torch.ops.aten.where.self(bitwise_or, convert_element_type_2, convert_element_type);  convert_element_type_2 = convert_element_type = None
        scalar_tensor_1: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_2: "f32[2, 3]" = torch.ops.aten.where.self(bitwise_or, scalar_tensor_1, add);  bitwise_or = scalar_tensor_1 = add = None
        add_2: "f32[2, 3]" = torch.ops.aten.add.Tensor(where_1, where_2)
        mul_3: "f32[2, 3]" = torch.ops.aten.mul.Tensor(add_2, 65536.0)
        add_3: "f32[2, 3]" = torch.ops.aten.add.Tensor(mul_3, add_2);  mul_3 = None
        sub_1: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_3, add_2)
        sub_2: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_3, sub_1);  add_3 = sub_1 = None
        abs_3: "f32[2, 3]" = torch.ops.aten.abs.default(sub_2)
        lt_1: "b8[2, 3]" = torch.ops.aten.lt.Scalar(abs_3, inf);  abs_3 = None
        sub_3: "f32[2, 3]" = torch.ops.aten.sub.Tensor(where_1, sub_2);  where_1 = sub_2 = None
        add_4: "f32[2, 3]" = torch.ops.aten.add.Tensor(sub_3, where_2);  sub_3 = where_2 = None
        convert_element_type_3: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(add_2, torch.bfloat16);  add_2 = None
        scalar_tensor_2: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_3: "f32[2, 3]" = torch.ops.aten.where.self(lt_1, add_4, scalar_tensor_2);  lt_1 = add_4 = scalar_tensor_2 = None
        convert_element_type_4: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(where_3, torch.bfloat16);  where_3 = None
        return (convert_element_type_3, convert_element_type_4)
class chain_1(torch.nn.Module):
    def forward(self, arg0_1: "bf16[2, 3]", arg1_1: "bf16[2, 3]", arg2_1: "bf16[2, 3]", arg3_1: "bf16[2, 3]"):
        convert_element_type: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg0_1, torch.float32);  arg0_1 = None
        convert_element_type_1: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg1_1, torch.float32);  arg1_1 = None
        abs_1: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type)
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(abs_1, 0.00390625);  abs_1 = None
        abs_2: "f32[2, 3]" = torch.ops.aten.abs.default(convert_element_type_1)
        le: "b8[2, 3]" = torch.ops.aten.le.Tensor(abs_2, mul);  abs_2 = mul = None
        scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where: "f32[2, 3]" = torch.ops.aten.where.self(le, convert_element_type_1, scalar_tensor);  le = convert_element_type_1 = scalar_tensor = None
        convert_element_type_2: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg2_1, torch.float32);  arg2_1 = None
        convert_element_type_3: "f32[2, 3]" = torch.ops.prims.convert_element_type.default(arg3_1, torch.float32);  arg3_1 = None
        div: "f32[2, 3]" = torch.ops.aten.div.Tensor(convert_element_type_2, convert_element_type_3);  convert_element_type_2 = convert_element_type_3 = None
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(where, div);  where = div = None
        add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(convert_element_type, add)
        mul_1: "f32[2, 3]" = torch.ops.aten.mul.Tensor(add_1, 65536.0)
        add_2: "f32[2, 3]" = torch.ops.aten.add.Tensor(mul_1, add_1);  mul_1 = None
        sub: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_2, add_1)
        sub_1: "f32[2, 3]" = torch.ops.aten.sub.Tensor(add_2, sub);  add_2 = sub = None
        abs_3: "f32[2, 3]" = torch.ops.aten.abs.default(sub_1)
        lt: "b8[2, 3]" = torch.ops.aten.lt.Scalar(abs_3, inf);  abs_3 = None
        sub_2: "f32[2, 3]" = torch.ops.aten.sub.Tensor(convert_element_type, sub_1);  convert_element_type = sub_1 = None
        add_3: "f32[2, 3]" = torch.ops.aten.add.Tensor(sub_2, add);  sub_2 = add = None
        convert_element_type_4: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(add_1, torch.bfloat16);  add_1 = None
        scalar_tensor_1: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where_1: "f32[2, 3]" = torch.ops.aten.where.self(lt, add_3, scalar_tensor_1);  lt = add_3 = scalar_tensor_1 = None
        convert_element_type_5: "bf16[2, 3]" = torch.ops.prims.convert_element_type.default(where_1, torch.bfloat16);  where_1 = None
        return (convert_element_type_4, convert_element_type_5)""",
        )
