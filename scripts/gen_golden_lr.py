#!/usr/bin/python3
"""Golden LR/momentum values for tests/test_lr_schedule.cpp -> tests/golden/lr_schedules.json.

DeepSpeed cannot be installed here, so this script re-implements the formulas of
deepspeed/runtime/lr_schedules.py (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
LRRangeTest) in plain Python, written from DeepSpeed's source and docs, and then *simulates
DeepSpeed's engine protocol* rather than assuming an index mapping:

  * the scheduler is constructed with last_batch_iteration=-1; its constructor writes an
    initial lr (and, for OneCycle with cycle_momentum, betas) into the optimizer's groups;
  * engine._take_model_step runs optimizer.step() and then, unless the step overflowed,
    lr_scheduler.step(), which increments last_batch_iteration and rewrites the groups.

So the value recorded for update k (0-based) is whatever sits in param_groups[0] when
optimizer.step() runs for the k-th time. The C++ side computes it in closed form; a
mismatch in the mapping shows up as an off-by-one here.

Usage: /usr/bin/python3 scripts/gen_golden_lr.py   (no third-party modules needed)
"""
import json
import math
import os


class FakeOptimizer:
    """Stands in for torch.optim.Optimizer: only param_groups/defaults are touched."""

    def __init__(self, lr, betas=(0.9, 0.999), n_groups=1):
        self.param_groups = [{'lr': lr, 'betas': betas} for _ in range(n_groups)]
        self.defaults = {'lr': lr, 'betas': betas}


def set_group_lrs(opt, lrs):
    # zip() stops at the shorter list, as DeepSpeed's update_lr does.
    for group, lr in zip(opt.param_groups, lrs):
        group['lr'] = lr


def warmup_gamma(it, warmup_steps, warmup_type):
    """Warmup fraction at last_batch_iteration `it` (< warmup_steps)."""
    if warmup_type == 'log':
        return (1.0 / math.log(warmup_steps)) * math.log(it + 1)  # DeepSpeed's inverse_log_warm_up
    assert warmup_type == 'linear'
    return it / warmup_steps


class WarmupLR:
    def __init__(self, opt, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type='log', total_num_steps=None):
        self.opt = opt
        self.min_lr = warmup_min_lr
        self.delta = warmup_max_lr - warmup_min_lr
        self.warmup = max(2, warmup_num_steps)  # DeepSpeed clamps to >= 2 (log(1) = 0)
        self.warmup_type = warmup_type
        self.total = total_num_steps
        self.it = -1
        set_group_lrs(opt, [self.lr()] * len(opt.param_groups))

    def gamma(self):
        if self.it < self.warmup:
            return warmup_gamma(self.it, self.warmup, self.warmup_type)
        if self.total is None:  # WarmupLR: hold at max
            return 1.0
        # WarmupDecayLR: linear decay to 0 at total_num_steps
        return max(0.0, float(self.total - self.it) / float(max(1.0, self.total - self.warmup)))

    def lr(self):
        if self.it < 0:  # "before it has started": min lr
            return self.min_lr
        return self.min_lr + self.delta * self.gamma()

    def step(self):
        self.it += 1
        set_group_lrs(self.opt, [self.lr()] * len(self.opt.param_groups))


def WarmupDecayLR(opt, total_num_steps, **kw):
    return WarmupLR(opt, total_num_steps=total_num_steps, **kw)


class WarmupCosineLR:
    def __init__(self, opt, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type='log'):
        self.opt = opt
        self.total = total_num_steps
        self.warmup = max(2, warmup_num_steps)
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.org_lrs = [g['lr'] for g in opt.param_groups]  # the optimizer's configured lr
        self.it = -1
        self.apply()

    def ratio(self):
        if self.it < self.warmup:
            r = warmup_gamma(self.it, self.warmup, self.warmup_type)
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        done = self.it - self.warmup + 1
        span = self.total - self.warmup
        r = (1 + math.cos(math.pi * done / span)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * r)

    def apply(self):
        if self.it < 0:
            # DeepSpeed returns the one-element list [0.0] here: only group 0 gets lr 0.
            set_group_lrs(self.opt, [0.0])
        else:
            r = self.ratio()
            set_group_lrs(self.opt, [lr * r for lr in self.org_lrs])

    def step(self):
        self.it += 1
        self.apply()


class LRRangeTest:
    def __init__(self, opt, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False):
        self.opt = opt
        self.min_lr = lr_range_test_min_lr
        self.size = lr_range_test_step_size
        self.rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.it = -1
        set_group_lrs(opt, [self.min_lr] * len(opt.param_groups))

    def lr(self):
        interval = float(self.it + 1) / self.size
        if self.staircase:
            interval = math.floor(interval)
        return self.min_lr * (1 + self.rate * interval)

    def step(self):
        self.it += 1
        set_group_lrs(self.opt, [self.lr()] * len(self.opt.param_groups))


class OneCycle:
    def __init__(self, opt, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0,
                 cycle_first_step_size=2000, cycle_second_step_size=None,
                 cycle_first_stair_count=0, cycle_second_stair_count=None, decay_step_size=0,
                 cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0):
        self.opt = opt
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        # Stair counts are stored by DeepSpeed but no formula reads them.
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = decay_step_size == 0 or decay_lr_rate == 0
        self.skip_mom_decay = decay_step_size == 0 or decay_mom_rate == 0
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        self.cycle_momentum = cycle_momentum and 'betas' in opt.defaults
        for g in opt.param_groups:
            g['lr'] = cycle_min_lr
            if self.cycle_momentum:
                g['betas'] = (cycle_min_mom, 0.99)  # constructor: *min* momentum, beta2 0.99
        self.it = -1

    def scale(self):
        bi = self.it + 1
        cycle = math.floor(1 + bi / self.total_size)
        x = 1.0 + bi / self.total_size - cycle
        if x <= self.step_ratio:
            return x / self.step_ratio
        return (x - 1) / (self.step_ratio - 1)

    def lr(self):
        if self.it < self.total_size:
            return self.min_lr + (self.max_lr - self.min_lr) * self.scale()
        if self.skip_lr_decay:
            return self.min_lr
        interval = (self.it - self.total_size + 1) / self.decay_step_size
        return self.min_lr / (1 + self.decay_lr_rate * interval)

    def mom(self):
        if self.it < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self.scale()
        if self.skip_mom_decay:
            return self.max_mom
        interval = (self.it - self.total_size + 1) / self.decay_step_size
        return self.max_mom * (1 + self.decay_mom_rate * interval)

    def step(self):
        self.it += 1
        for g in self.opt.param_groups:
            g['lr'] = self.lr()
            if self.cycle_momentum:
                g['betas'] = (self.mom(), 0.99)


class Constant:
    def __init__(self, opt):
        self.opt = opt

    def step(self):
        pass


def make(kind, opt, params):
    p = dict(params)
    if kind == '':
        return Constant(opt)
    if kind == 'WarmupLR':
        return WarmupLR(opt, **p)
    if kind == 'WarmupDecayLR':
        return WarmupDecayLR(opt, **p)
    if kind == 'WarmupCosineLR':
        return WarmupCosineLR(opt, **p)
    if kind == 'OneCycle':
        return OneCycle(opt, **p)
    if kind == 'LRRangeTest':
        return LRRangeTest(opt, **p)
    raise ValueError(kind)


def run_case(name, kind, params, base_lr, steps, beta1=0.9):
    """Drives the schedule like DeepSpeed's engine and records group 0 at each update."""
    opt = FakeOptimizer(base_lr, betas=(beta1, 0.999))
    sched = make(kind, opt, params)
    wanted = set(steps)
    out = []
    for k in range(max(steps) + 1):
        if k in wanted:  # what optimizer.step() number k would read
            g = opt.param_groups[0]
            cycles_mom = isinstance(sched, OneCycle) and sched.cycle_momentum
            out.append({'step': k, 'lr': g['lr'], 'momentum': g['betas'][0] if cycles_mom else None})
        # optimizer.step() happens here; then the engine steps the scheduler
        sched.step()
    return {'name': name, 'type': kind, 'base_lr': base_lr, 'params': params, 'expect': out}


def main():
    cases = []
    warm = [0, 1, 2, 5, 9, 10, 11, 12, 20, 100]
    decay = [0, 1, 2, 5, 9, 10, 11, 12, 30, 49, 50, 51, 52, 60]
    cases.append(run_case('constant', '', {}, 3e-4, [0, 1, 1000]))
    for wt in ('log', 'linear'):
        cases.append(run_case(f'warmup_{wt}', 'WarmupLR',
                              {'warmup_min_lr': 1e-5, 'warmup_max_lr': 1e-3,
                               'warmup_num_steps': 10, 'warmup_type': wt}, 5e-2, warm))
        cases.append(run_case(f'warmup_decay_{wt}', 'WarmupDecayLR',
                              {'total_num_steps': 50, 'warmup_min_lr': 0.0, 'warmup_max_lr': 2e-3,
                               'warmup_num_steps': 10, 'warmup_type': wt}, 5e-2, decay))
        cases.append(run_case(f'warmup_cosine_{wt}', 'WarmupCosineLR',
                              {'total_num_steps': 50, 'warmup_min_ratio': 0.1,
                               'warmup_num_steps': 10, 'cos_min_ratio': 0.01, 'warmup_type': wt},
                              2e-3, decay + [70, 89, 90, 91, 100]))
    # warmup_num_steps below 2 is raised to 2 by DeepSpeed
    cases.append(run_case('warmup_one_step', 'WarmupLR',
                          {'warmup_min_lr': 1e-4, 'warmup_max_lr': 1e-3, 'warmup_num_steps': 1,
                           'warmup_type': 'log'}, 1.0, [0, 1, 2, 3, 10]))
    # DeepSpeed's defaults (log warmup over 1000 steps)
    cases.append(run_case('warmup_defaults', 'WarmupLR', {}, 1.0, [0, 1, 2, 10, 500, 998, 999, 1000, 1001, 5000]))
    cases.append(run_case('warmup_decay_defaults', 'WarmupDecayLR', {'total_num_steps': 4000}, 1.0,
                          [0, 1, 999, 1000, 1001, 1002, 2500, 3999, 4000, 4001, 4100]))
    cases.append(run_case('warmup_cosine_defaults', 'WarmupCosineLR', {'total_num_steps': 3000}, 6e-4,
                          [0, 1, 2, 999, 1000, 1001, 2000, 2999, 3000, 3001, 5000]))
    onecycle_steps = [0, 1, 2, 5, 9, 10, 11, 15, 20, 29, 30, 31, 32, 35, 40, 100]
    cases.append(run_case('onecycle_decay', 'OneCycle',
                          {'cycle_min_lr': 1e-4, 'cycle_max_lr': 1e-3, 'decay_lr_rate': 0.5,
                           'cycle_first_step_size': 10, 'cycle_second_step_size': 20,
                           'decay_step_size': 5, 'cycle_momentum': True, 'cycle_min_mom': 0.85,
                           'cycle_max_mom': 0.95, 'decay_mom_rate': 0.01}, 1.0, onecycle_steps))
    cases.append(run_case('onecycle_stairs_no_decay', 'OneCycle',
                          {'cycle_min_lr': 2e-4, 'cycle_max_lr': 2e-3, 'cycle_first_step_size': 8,
                           'cycle_first_stair_count': 4, 'decay_lr_rate': 0.3,
                           'cycle_momentum': True}, 1.0,
                          [0, 1, 3, 4, 7, 8, 9, 12, 15, 16, 17, 30]))
    cases.append(run_case('onecycle_no_momentum', 'OneCycle',
                          {'cycle_min_lr': 1e-3, 'cycle_max_lr': 1e-2, 'cycle_first_step_size': 5,
                           'cycle_second_step_size': 5, 'decay_step_size': 2, 'decay_lr_rate': 1.0,
                           'cycle_momentum': False}, 1.0, [0, 1, 4, 5, 6, 9, 10, 11, 12, 20]))
    rr_steps = [0, 1, 2, 9, 10, 11, 19, 20, 21, 25, 100]
    for stair in (False, True):
        cases.append(run_case(f'range_test_{"staircase" if stair else "continuous"}', 'LRRangeTest',
                              {'lr_range_test_min_lr': 1e-3, 'lr_range_test_step_size': 10,
                               'lr_range_test_step_rate': 0.5, 'lr_range_test_staircase': stair},
                              1.0, rr_steps))

    doc = {
        'generator': 'scripts/gen_golden_lr.py',
        'source': 'formulas of deepspeed/runtime/lr_schedules.py, driven as engine._take_model_step does',
        'note': 'expect[].lr/momentum: the value optimizer update `step` (0-based) runs with',
        'cases': cases,
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, 'tests', 'golden', 'lr_schedules.json')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(doc, f, indent=1)
        f.write('\n')
    print(f'wrote {path}: {len(cases)} cases')


if __name__ == '__main__':
    main()
