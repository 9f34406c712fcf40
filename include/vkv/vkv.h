// Umbrella header: everything a custom engine needs from vkv.
#pragma once

#include "vkv/agreed_step.h"
#include "vkv/backend.h"
#include "vkv/block_backing.h"
#include "vkv/config.h"
#include "vkv/cuda_backend.h"
#include "vkv/error.h"
#include "vkv/forwarding_backend.h"
#include "vkv/host_all_reduce.h"
#include "vkv/host_backend.h"
#include "vkv/kv_cache.h"
#include "vkv/layout.h"
#include "vkv/limiting_backend.h"
#include "vkv/shared_budget.h"
#include "vkv/statistics_backend.h"
#include "vkv/stats.h"
