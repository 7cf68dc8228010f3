#include "megamoe/weights.h"
