// LR schedules against golden values from scripts/gen_golden_lr.py (DeepSpeed's formulas driven
// as DeepSpeed's engine drives them) plus hand-checked values and input errors.
// Config parsing is not exercised here: SchedulerConfig is filled field by field.
#include <cmath>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "polytrain/common/config.h"
#include "polytrain/common/error.h"
#include "polytrain/optim/lr_schedule.h"

namespace polytrain {
namespace {

using nlohmann::json;

SchedulerConfig scheduler_from(const std::string& type, const json& params) {
  SchedulerConfig c;
  c.type = type;
  for (const auto& [key, v] : params.items()) {
    if (key == "warmup_min_lr") c.warmup_min_lr = v.get<double>();
    else if (key == "warmup_max_lr") c.warmup_max_lr = v.get<double>();
    else if (key == "warmup_num_steps") c.warmup_num_steps = v.get<int64_t>();
    else if (key == "warmup_type") c.warmup_type = v.get<std::string>();
    else if (key == "total_num_steps") c.total_num_steps = v.get<int64_t>();
    else if (key == "warmup_min_ratio") c.warmup_min_ratio = v.get<double>();
    else if (key == "cos_min_ratio") c.cos_min_ratio = v.get<double>();
    else if (key == "cycle_min_lr") c.cycle_min_lr = v.get<double>();
    else if (key == "cycle_max_lr") c.cycle_max_lr = v.get<double>();
    else if (key == "decay_lr_rate") c.decay_lr_rate = v.get<double>();
    else if (key == "cycle_first_step_size") c.cycle_first_step_size = v.get<int64_t>();
    else if (key == "cycle_second_step_size") c.cycle_second_step_size = v.get<int64_t>();
    else if (key == "cycle_first_stair_count") c.cycle_first_stair_count = v.get<int64_t>();
    else if (key == "cycle_second_stair_count") c.cycle_second_stair_count = v.get<int64_t>();
    else if (key == "decay_step_size") c.decay_step_size = v.get<int64_t>();
    else if (key == "cycle_momentum") c.cycle_momentum = v.get<bool>();
    else if (key == "cycle_min_mom") c.cycle_min_mom = v.get<double>();
    else if (key == "cycle_max_mom") c.cycle_max_mom = v.get<double>();
    else if (key == "decay_mom_rate") c.decay_mom_rate = v.get<double>();
    else if (key == "lr_range_test_min_lr") c.lr_range_test_min_lr = v.get<double>();
    else if (key == "lr_range_test_step_size") c.lr_range_test_step_size = v.get<int64_t>();
    else if (key == "lr_range_test_step_rate") c.lr_range_test_step_rate = v.get<double>();
    else if (key == "lr_range_test_staircase") c.lr_range_test_staircase = v.get<bool>();
    else ADD_FAILURE() << "golden file has an unknown scheduler param " << key;
  }
  return c;
}

::testing::AssertionResult close_rel(double got, double want, double rel = 1e-12) {
  if (std::fabs(got - want) <= rel * std::max(std::fabs(got), std::fabs(want)))
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << got << " want " << want;
}

TEST(LrSchedule, MatchesDeepSpeedGolden) {
  const std::string path = std::string(POLYTRAIN_SOURCE_DIR) + "/tests/golden/lr_schedules.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "missing " << path << " (run scripts/gen_golden_lr.py)";
  const json doc = json::parse(in);
  ASSERT_GE(doc.at("cases").size(), 10u);
  int checked = 0;
  for (const auto& c : doc.at("cases")) {
    SCOPED_TRACE(c.at("name").get<std::string>());
    const auto cfg = scheduler_from(c.at("type").get<std::string>(), c.at("params"));
    const auto sched = make_lr_schedule(cfg, c.at("base_lr").get<double>());
    for (const auto& e : c.at("expect")) {
      const int64_t step = e.at("step").get<int64_t>();
      EXPECT_TRUE(close_rel(sched->lr(step), e.at("lr").get<double>())) << "lr at step " << step;
      const auto mom = sched->momentum(step);
      if (e.at("momentum").is_null()) {
        EXPECT_FALSE(mom.has_value()) << "step " << step;
      } else {
        ASSERT_TRUE(mom.has_value()) << "step " << step;
        EXPECT_TRUE(close_rel(*mom, e.at("momentum").get<double>())) << "momentum at step " << step;
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 150);
}

// Values worked out by hand from DeepSpeed's formulas with update k = iteration k - 1.
TEST(LrSchedule, HandCheckedWarmup) {
  SchedulerConfig c;
  c.type = "WarmupLR";
  c.warmup_min_lr = 0.0;
  c.warmup_max_lr = 1.0;
  c.warmup_num_steps = 4;
  c.warmup_type = "linear";
  auto s = make_lr_schedule(c, 123.0);
  EXPECT_EQ(s->lr(0), 0.0);   // constructor: min lr
  EXPECT_EQ(s->lr(1), 0.0);   // iteration 0: 0/4
  EXPECT_EQ(s->lr(2), 0.25);  // iteration 1: 1/4
  EXPECT_EQ(s->lr(4), 0.75);
  EXPECT_EQ(s->lr(5), 1.0);   // iteration 4 >= warmup
  EXPECT_EQ(s->lr(1000000), 1.0);
  EXPECT_FALSE(s->momentum(3).has_value());

  c.warmup_type = "log";  // iteration i: log(i + 1) / log(4)
  s = make_lr_schedule(c, 0.0);
  EXPECT_DOUBLE_EQ(s->lr(2), std::log(2.0) / std::log(4.0));  // = 0.5
  EXPECT_DOUBLE_EQ(s->lr(2), 0.5);
  EXPECT_DOUBLE_EQ(s->lr(4), std::log(4.0) / std::log(4.0));

  c.type = "WarmupDecayLR";  // after warmup: (T - i) / (T - W)
  c.total_num_steps = 14;
  s = make_lr_schedule(c, 0.0);
  EXPECT_DOUBLE_EQ(s->lr(5), 1.0);   // iteration 4: 10/10
  EXPECT_DOUBLE_EQ(s->lr(10), 0.5);  // iteration 9: 5/10
  EXPECT_EQ(s->lr(15), 0.0);         // iteration 14: 0
  EXPECT_EQ(s->lr(30), 0.0);         // clamped at 0
}

TEST(LrSchedule, HandCheckedCosineOneCycleRangeTestConstant) {
  SchedulerConfig c;
  c.type = "WarmupCosineLR";
  c.warmup_num_steps = 2;
  c.warmup_type = "linear";
  c.warmup_min_ratio = 0.0;
  c.cos_min_ratio = 0.0;
  c.total_num_steps = 6;  // cosine over 4 iterations
  auto s = make_lr_schedule(c, 2.0);
  EXPECT_EQ(s->lr(0), 0.0);
  EXPECT_EQ(s->lr(1), 0.0);             // iteration 0: ratio 0
  EXPECT_DOUBLE_EQ(s->lr(2), 1.0);      // iteration 1: ratio 1/2
  EXPECT_DOUBLE_EQ(s->lr(3), 2.0 * (1 + std::cos(M_PI / 4)) / 2);  // iteration 2: 1 of 4 done
  EXPECT_NEAR(s->lr(4), 1.0, 1e-15);    // iteration 3: 2 of 4 done: cos(pi/2) = 0
  EXPECT_NEAR(s->lr(6), 0.0, 1e-15);    // iteration 5: 4 of 4 done: cos(pi) = -1
  EXPECT_DOUBLE_EQ(s->lr(7), s->lr(5)); // past the total the cosine rises again (DeepSpeed)

  c = SchedulerConfig{};
  c.type = "OneCycle";
  c.cycle_min_lr = 1.0;
  c.cycle_max_lr = 3.0;
  c.cycle_first_step_size = 2;  // up over 2, down over 2
  c.cycle_min_mom = 0.5;
  c.cycle_max_mom = 0.9;
  s = make_lr_schedule(c, 0.0);
  EXPECT_EQ(s->lr(0), 1.0);
  EXPECT_EQ(*s->momentum(0), 0.5);  // DeepSpeed's constructor writes cycle_min_mom
  EXPECT_DOUBLE_EQ(s->lr(1), 2.0);  // iteration 0 is evaluated at 1 of 4: half way up
  EXPECT_DOUBLE_EQ(*s->momentum(1), 0.7);
  EXPECT_DOUBLE_EQ(s->lr(2), 3.0);  // peak
  EXPECT_DOUBLE_EQ(*s->momentum(2), 0.5);
  EXPECT_DOUBLE_EQ(s->lr(3), 2.0);
  EXPECT_DOUBLE_EQ(s->lr(4), 1.0);
  EXPECT_DOUBLE_EQ(*s->momentum(4), 0.9);
  EXPECT_EQ(s->lr(50), 1.0);        // no decay configured: stays at min
  EXPECT_EQ(*s->momentum(50), 0.9);
  c.decay_step_size = 2;
  c.decay_lr_rate = 1.0;
  s = make_lr_schedule(c, 0.0);
  // decay at iteration i >= 4: min / (1 + rate * (i - 4 + 1) / decay_step_size)
  EXPECT_DOUBLE_EQ(s->lr(5), 1.0 / 1.5);  // iteration 4
  EXPECT_DOUBLE_EQ(s->lr(6), 0.5);        // iteration 5
  EXPECT_DOUBLE_EQ(s->lr(7), 0.4);        // iteration 6
  c.cycle_momentum = false;
  EXPECT_FALSE(make_lr_schedule(c, 0.0)->momentum(1).has_value());

  c = SchedulerConfig{};
  c.type = "LRRangeTest";
  c.lr_range_test_min_lr = 0.1;
  c.lr_range_test_step_size = 4;
  c.lr_range_test_step_rate = 2.0;
  s = make_lr_schedule(c, 0.0);
  EXPECT_DOUBLE_EQ(s->lr(0), 0.1);
  EXPECT_DOUBLE_EQ(s->lr(2), 0.1 * (1 + 2.0 * 2 / 4));
  c.lr_range_test_staircase = true;
  s = make_lr_schedule(c, 0.0);
  EXPECT_DOUBLE_EQ(s->lr(3), 0.1);
  EXPECT_DOUBLE_EQ(s->lr(4), 0.3);
  EXPECT_DOUBLE_EQ(s->lr(9), 0.5);

  s = make_lr_schedule(SchedulerConfig{}, 7e-4);
  EXPECT_EQ(s->lr(0), 7e-4);
  EXPECT_EQ(s->lr(99999), 7e-4);
  EXPECT_FALSE(s->momentum(0).has_value());
}

TEST(LrSchedule, RejectsBadInput) {
  SchedulerConfig c;
  c.type = "Cosine";
  EXPECT_THROW(make_lr_schedule(c, 1.0), InputError);
  c.type = "WarmupLR";
  c.warmup_type = "exp";
  EXPECT_THROW(make_lr_schedule(c, 1.0), InputError);
  c = SchedulerConfig{};
  c.type = "WarmupDecayLR";  // total_num_steps left at 0
  EXPECT_THROW(make_lr_schedule(c, 1.0), InputError);
  c.type = "WarmupCosineLR";
  c.total_num_steps = c.warmup_num_steps;
  EXPECT_THROW(make_lr_schedule(c, 1.0), InputError);
  c = SchedulerConfig{};
  c.type = "OneCycle";
  c.cycle_first_step_size = 0;
  EXPECT_THROW(make_lr_schedule(c, 1.0), InputError);
  c = SchedulerConfig{};
  c.type = "LRRangeTest";
  c.lr_range_test_step_size = 0;
  try {
    make_lr_schedule(c, 1.0);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("lr_range_test_step_size"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace polytrain
