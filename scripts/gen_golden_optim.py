#!/usr/bin/python3
"""Golden parameter trajectories for tests/test_optimizers.cpp -> tests/golden/optimizers.json.

Run with Debian's PyTorch 1.13: /usr/bin/python3 scripts/gen_golden_optim.py

A few float32 tensors with fixed values (names include a 'bias' and a 'LayerNorm.weight', so
the no-decay grouping matters; one tensor starts at zero and one has a norm above LAMB's
clamp) get deterministic gradients for 5 steps, under:
  torch.optim.AdamW, torch.optim.Adam (L2 weight decay), torch.optim.SGD (momentum+nesterov),
  torch.optim.Adagrad, and LAMB as torch_optimizer.Lamb defines it (re-implemented below from
  torch_optimizer/lamb.py, which is not installed here).
The LR (and for one case beta1) changes every step, as a schedule would set it.
Parameters are recorded after every step.
"""
import json
import math
import os

import torch

NO_DECAY = ['bias', 'LayerNorm', 'layer_norm', 'ln_']  # polytrain's OptimizerConfig default
STEPS = 5


def initial_params():
    """name -> float32 tensor; values from closed forms the C++ test does not need (they are
    stored in the JSON)."""
    def from_fn(shape, fn):
        n = math.prod(shape)
        return torch.tensor([fn(i) for i in range(n)], dtype=torch.float64).to(torch.float32).reshape(shape)

    return [
        ('encoder.weight', from_fn([3, 4], lambda i: 0.5 * math.sin(0.7 * i + 0.3))),
        ('encoder.bias', torch.zeros(4, dtype=torch.float32)),  # LAMB: ||w|| = 0 -> trust 1
        ('encoder.LayerNorm.weight', from_fn([4], lambda i: 1.0 + 0.1 * math.cos(i))),
        ('big.weight', from_fn([4, 4], lambda i: 4.0 * math.cos(0.9 * i + 0.1) + 0.5)),  # ||w|| > 10
        ('head.weight', from_fn([2, 3], lambda i: 0.1 * (i - 2.5))),
    ]


def gradient(j, t, p):
    """Gradient of parameter j at step t (1-based): float32(0.3 cos(0.37 i + 1.3 j + 0.61 t)) + 0.05 p."""
    n = p.numel()
    base = torch.tensor([0.3 * math.cos(0.37 * i + 1.3 * j + 0.61 * t) for i in range(n)],
                        dtype=torch.float64).to(torch.float32).reshape(p.shape)
    return base + 0.05 * p


class Lamb(torch.optim.Optimizer):
    """torch_optimizer.Lamb (jettify/pytorch-optimizer): Adam direction m / (sqrt(v) + eps)
    without bias correction inside, plus weight_decay * w; the step is scaled by
    lr * [sqrt(1 - b2^t) / (1 - b1^t) if debias] * trust, trust = min(||w||, clamp) / ||step||,
    or 1 when either norm is 0 (or adam=True)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 clamp_value=10.0, adam=False, debias=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.clamp_value, self.adam, self.debias = clamp_value, adam, debias

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group['betas']
            for p in group['params']:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st['step'] = 0
                    st['exp_avg'] = torch.zeros_like(p)
                    st['exp_avg_sq'] = torch.zeros_like(p)
                st['step'] += 1
                m, v = st['exp_avg'], st['exp_avg_sq']
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                bc = 1.0
                if self.debias:
                    bc = math.sqrt(1 - beta2 ** st['step']) / (1 - beta1 ** st['step'])
                step_size = group['lr'] * bc
                w_norm = torch.norm(p).clamp(0, self.clamp_value)
                adam_step = m / v.sqrt().add(group['eps'])
                if group['weight_decay'] != 0:
                    adam_step.add_(p, alpha=group['weight_decay'])
                a_norm = torch.norm(adam_step)
                trust = 1 if (w_norm == 0 or a_norm == 0) else w_norm / a_norm
                if self.adam:
                    trust = 1
                # torch_optimizer passes the 0-d float32 product as the Scalar alpha
                p.add_(adam_step, alpha=float(-step_size * trust))


def build(cfg, named):
    wd = cfg['weight_decay']
    decay = [p for n, p in named if not any(s in n for s in NO_DECAY)]
    no_decay = [p for n, p in named if any(s in n for s in NO_DECAY)]
    groups = [{'params': decay, 'weight_decay': wd}, {'params': no_decay, 'weight_decay': 0.0}]
    betas = (cfg.get('beta1', 0.9), cfg.get('beta2', 0.999))
    kind = cfg['type']
    if kind == 'AdamW' or (kind == 'Adam' and cfg.get('adam_w_mode', True)):
        return torch.optim.AdamW(groups, lr=cfg['lr'], betas=betas, eps=cfg['eps'],
                                 amsgrad=cfg.get('amsgrad', False))
    if kind == 'Adam':
        return torch.optim.Adam(groups, lr=cfg['lr'], betas=betas, eps=cfg['eps'],
                                amsgrad=cfg.get('amsgrad', False))
    if kind == 'SGD':
        return torch.optim.SGD(groups, lr=cfg['lr'], momentum=cfg['momentum'],
                               dampening=cfg['dampening'], nesterov=cfg['nesterov'])
    if kind == 'Adagrad':
        return torch.optim.Adagrad(groups, lr=cfg['lr'], lr_decay=cfg['lr_decay'], eps=cfg['eps'],
                                   initial_accumulator_value=cfg['initial_accumulator_value'])
    if kind == 'Lamb':
        return Lamb(groups, lr=cfg['lr'], betas=betas, eps=cfg['eps'], clamp_value=cfg['clamp_value'],
                    debias=cfg['bias_correction'])
    raise ValueError(kind)


def run_case(name, cfg, lr_scale, beta1s=None):
    named = [(n, p.clone().requires_grad_(True)) for n, p in initial_params()]
    opt = build(cfg, named)
    lrs = [cfg['lr'] * s for s in lr_scale]
    after = []
    for t in range(1, STEPS + 1):
        for g in opt.param_groups:
            g['lr'] = lrs[t - 1]
            if beta1s is not None:
                g['betas'] = (beta1s[t - 1], g['betas'][1])
        with torch.no_grad():
            for j, (_, p) in enumerate(named):
                p.grad = gradient(j, t, p)
        opt.step()
        after.append([p.detach().reshape(-1).tolist() for _, p in named])
    return {'name': name, 'config': cfg, 'lrs': lrs, 'beta1s': beta1s, 'after_step': after}


def main():
    torch.set_num_threads(1)
    scale = [1.0, 0.9, 0.8, 0.7, 0.6]
    cases = [
        run_case('adamw', {'type': 'AdamW', 'lr': 1e-2, 'weight_decay': 0.1, 'eps': 1e-8}, scale,
                 beta1s=[0.9, 0.88, 0.86, 0.84, 0.82]),
        run_case('adam_l2', {'type': 'Adam', 'adam_w_mode': False, 'lr': 1e-2, 'weight_decay': 0.1,
                             'eps': 1e-8, 'beta2': 0.99}, scale),
        run_case('adam_w_mode_amsgrad', {'type': 'Adam', 'adam_w_mode': True, 'amsgrad': True,
                                         'lr': 2e-2, 'weight_decay': 0.05, 'eps': 1e-8}, scale),
        run_case('sgd_nesterov', {'type': 'SGD', 'lr': 5e-2, 'weight_decay': 0.1, 'momentum': 0.9,
                                  'dampening': 0.0, 'nesterov': True}, scale),
        run_case('adagrad', {'type': 'Adagrad', 'lr': 1e-1, 'weight_decay': 0.1, 'lr_decay': 0.01,
                             'initial_accumulator_value': 0.1, 'eps': 1e-10}, scale),
        run_case('lamb_debias', {'type': 'Lamb', 'lr': 1e-2, 'weight_decay': 0.1, 'eps': 1e-6,
                                 'clamp_value': 10.0, 'bias_correction': True}, scale,
                 beta1s=[0.9, 0.85, 0.8, 0.85, 0.9]),
        run_case('lamb_plain_clamped', {'type': 'Lamb', 'lr': 5e-2, 'weight_decay': 0.0, 'eps': 1e-6,
                                        'beta1': 0.8, 'beta2': 0.99, 'clamp_value': 1.0,
                                        'bias_correction': False}, scale),
    ]
    doc = {
        'generator': 'scripts/gen_golden_optim.py',
        'torch_version': torch.__version__,
        'no_decay': NO_DECAY,
        'gradient': 'g_j at step t (1-based) = float32(0.3*cos(0.37*i + 1.3*j + 0.61*t)) + 0.05*p_j',
        'params': [{'name': n, 'shape': list(p.shape), 'init': p.reshape(-1).tolist()}
                   for n, p in initial_params()],
        'cases': cases,
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, 'tests', 'golden', 'optimizers.json')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(doc, f, indent=1)
        f.write('\n')
    print(f'wrote {path}: {len(cases)} cases')


if __name__ == '__main__':
    main()
